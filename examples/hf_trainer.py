"""transformers' Trainer with zeroscan's callback: a small GPT-2 (built from
a config, no download) trained on CPU with a custom optimizer that was built
before the last block's MLP was unfrozen, so it never updates that MLP.

    pip install --no-build-isolation -e ".[transformers]"     # in the zeroscan checkout
    python examples/hf_trainer.py

The Trainer prints its own log rows; each row carries zeroscan's summary
scalars (so report_to gets them too), and the findings go to Python logging
once: here one "not_in_optimizer" warning for the MLP's four parameters.
"""

from __future__ import annotations

import logging
import tempfile

import torch
import transformers

import zeroscan
from zeroscan.integrations.transformers import ZeroscanCallback


def run(seed: int = 0, steps: int = 8) -> tuple[zeroscan.Report, list[dict[str, float]]]:
    """Trains `steps` steps; returns zeroscan's last report and the Trainer's log_history."""
    transformers.logging.set_verbosity_error()
    with torch.random.fork_rng(), tempfile.TemporaryDirectory() as out:
        torch.manual_seed(seed)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
        mlp = model.transformer.h[1].mlp
        mlp.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        mlp.requires_grad_(True)  # the bug: unfrozen after the optimizer was built
        ids = torch.randint(0, config.vocab_size, (64, 32))
        data = [{"input_ids": row, "labels": row} for row in ids]
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=8, logging_steps=4,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        callback = ZeroscanCallback()
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[callback], optimizers=(optimizer, None)
        )
        trainer.train()
    assert callback.report is not None
    return callback.report, trainer.state.log_history


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report, history = run()
    print("log_history:")
    for row in history:
        print(" ", row)
    print(report)
