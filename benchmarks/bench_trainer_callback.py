"""What zeroscan's Trainer callback costs a real transformers Trainer run.

A GPT-2 built from a config (no download) trains the same steps on the same
data twice per round, without and with ZeroscanCallback (reports at every
`--logging-steps` rows), alternating which goes first; the table gives the
median time per optimizer step of each and their ratio. Needs the
transformers extra (pip install --no-build-isolation -e ".[transformers]").

    python benchmarks/bench_trainer_callback.py            # 4 layers x 256 wide, 60 steps, 3 rounds
    python benchmarks/bench_trainer_callback.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from timing import describe_machine
from zeroscan.integrations.transformers import ZeroscanCallback


def train_seconds(config: transformers.GPT2Config, steps: int, logging_steps: int, zeroscan_on: bool) -> float:
    """Seconds per optimizer step of one Trainer run (the first two steps, warm-up, left out)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (8 * (steps + 2), 64), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    times: list[float] = []

    class Clock(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
            times.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps + 2, per_device_train_batch_size=8, logging_steps=logging_steps,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        callbacks = [ZeroscanCallback(), Clock()] if zeroscan_on else [Clock()]
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return (times[-1] - times[1]) / (len(times) - 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 layers, 20 steps, 1 round")
    a = parser.parse_args()
    if a.quick:
        a.layers, a.steps, a.rounds = 2, 20, 1
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=4, vocab_size=1024, n_positions=64)
    params = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    off: list[float] = []
    on: list[float] = []
    for r in range(a.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for flag in order:
            (on if flag else off).append(train_seconds(config, a.steps, a.logging_steps, flag))
    base, with_zs = statistics.median(off), statistics.median(on)
    print(f"# {describe_machine()}, transformers {transformers.__version__}")
    print(f"# GPT-2 {a.layers} layers x {a.width} ({params / 1e6:.1f}M parameters), batch 8 x 64 tokens, "
          f"{a.steps} steps, report every {a.logging_steps} steps, median of {a.rounds} rounds")
    print("| Trainer | ms / step | ratio |")
    print("|---|---:|---:|")
    print(f"| without zeroscan | {1e3 * base:.1f} | 1.00 |")
    print(f"| with ZeroscanCallback | {1e3 * with_zs:.1f} | {with_zs / base:.3f} |")


if __name__ == "__main__":
    main()
