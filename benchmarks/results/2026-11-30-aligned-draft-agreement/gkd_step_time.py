"""Seconds per step: trl's GKDTrainer (lmbda=0: token-level distillation on the target's own outputs, the
target's distributions as teacher) against SFTTrainer (sequence-level), the same 4 batches of 4 (the first 24
ShareGPT prompts in order), the same LoRA, bf16 draft, 2 threads. Needs the bf16 head run's traces in
runs/head13/traces (pacer-train run training/qwen2.5-coder-1.5b-0.5b-bf16.yaml, with --out there).

    python benchmarks/results/2026-11-30-aligned-draft-agreement/gkd_step_time.py sft   # 22.0 s/step (2026-11-30)
    python benchmarks/results/2026-11-30-aligned-draft-agreement/gkd_step_time.py gkd   # 33.2 s/step
"""
import json, sys, time, torch
from dataclasses import replace
from modeling_pacer.alignment import cli
from modeling_pacer.alignment.pipeline import alignment_dataset
from modeling_pacer.pairs import pair_from_args, load_model
from modeling_pacer.prompts import apply_chat_template
from modeling_pacer.replay import load_traces
from modeling_pacer.training.pipeline import sharegpt_rows
from trl import SFTTrainer
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

torch.set_num_threads(2)
config, pair_args, script = cli.parse_args(["--config", "training/qwen2.5-coder-0.5b-aligned.yaml", "--out", "/tmp/align/gkd"])
rows, _ = sharegpt_rows(replace(script, n=480))
pair_args.exact = False  # the teacher reads right-padded batches (sdpa); exactness is for decoding
pair = pair_from_args(pair_args)
tok = pair.tokenizer
prompts = [(pid, apply_chat_template(tok, text)) for pid, text in rows[:24]]
outputs = {pid: load_traces(f"runs/head13/traces/{pid}.safetensors").traces[0].output for pid, _ in prompts}
data = alignment_dataset(prompts, outputs).remove_columns(["prompt_id"])
if "gkd" in sys.argv:  # GKD skips trl's dataset preparation: labels built here, -100 on the prompt
    data = data.map(lambda r: {"labels": [t if m else -100 for t, m in zip(r["input_ids"], r["completion_mask"])]}).remove_columns(["completion_mask"])
steps, result = 4, {}
for kind in sys.argv[1:]:
    draft = load_model(pair.draft_source, dtype=torch.bfloat16, pair_name=pair.name)
    common = dict(output_dir=f"/tmp/align/{kind}", max_steps=steps, per_device_train_batch_size=4, learning_rate=2e-4,
                  use_cpu=True, report_to="none", save_strategy="no", max_length=640, gradient_checkpointing=False,
                  logging_steps=1, train_sampling_strategy="sequential", seed=0)
    if kind == "sft":
        trainer = SFTTrainer(model=draft, args=replace(config, **common), train_dataset=data, processing_class=tok,
                             peft_config=script.lora_config())
    else:
        teacher = pair.target  # the bf16 exact target
        args = GKDConfig(**common, lmbda=0.0, beta=0.0, completion_only_loss=True)  # beta 0: forward KL
        collator = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)
        trainer = GKDTrainer(model=draft, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok,
                             peft_config=script.lora_config(), data_collator=collator)
    start = time.perf_counter()
    trainer.train()
    result[kind] = (time.perf_counter() - start) / steps
    print(kind, result[kind], flush=True)
print(json.dumps(result))
