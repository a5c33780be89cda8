"""The Hugging Face Space's entry point: the app itself is `modeling_pacer.demo` (installed from
requirements.txt); its settings come from the Space's PACER_* variables."""

from modeling_pacer.demo import main

if __name__ == "__main__":
    raise SystemExit(main([]))
