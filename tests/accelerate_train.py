"""Run by `test_train_cli.test_two_processes` in every process of a distributed launch (torchrun, which
`accelerate launch --multi_gpu` uses underneath): pacer-train's pipeline (`train`) on the tiny pair of
`test_train_cli`. Each process writes what it saw to OUT_DIR/process-RANK.json."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from accelerate import PartialState  # noqa: E402

from test_train_cli import _args, _pair_and_prompts  # noqa: E402

from modeling_pacer import replay as traces  # noqa: E402
from modeling_pacer.training import pipeline  # noqa: E402

recorded = []
record_trace = traces.record_trace
traces.record_trace = lambda *a, **k: recorded.append(a[-1]) or record_trace(*a, **k)

out = Path(sys.argv[1])
pair, prompts = _pair_and_prompts()
summary = pipeline.train(_args(out), pair, prompts, "Tiny random prompts.")
state = PartialState()
(out / f"process-{state.process_index}.json").write_text(
    json.dumps(dict(num_processes=state.num_processes, summary_keys=sorted(summary), recorded=recorded))
)
