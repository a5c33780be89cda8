"""The Gradio Space (`app.py`), installed as `modeling_pacer.demo`; `pacer-demo` launches it locally."""
