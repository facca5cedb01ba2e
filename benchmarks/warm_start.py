"""How good is version 0 after a short supervised warm start, and can RL take it to the target?

For each warm-start step count: build the preset's model from scratch, warm-start it, and measure the
mean reward of completions sampled at T=1 and the greedy accuracy (reward of the argmax completion) on
held-out prompts. With ``--rl``, then run a plain on-policy GRPO loop (this package's advantages and
loss, one optimizer step per batch) from the preset's own version 0 until the mean sampled reward
reaches ``--target``, to check that the preset leaves RL something to learn and that it can learn it.

    .venv/bin/python benchmarks/warm_start.py --preset tiny-arith --rl
    .venv/bin/python benchmarks/warm_start.py --quick

The last line printed is one JSON object: ``{"preset", "sweep": [{"steps", "sft_seconds",
"sampled_reward", "greedy_reward"}, ...], "rl_lr", "rl": {"steps_to_target", "seconds_to_target",
"final_reward", "curve"}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from veriroll.coordinator.advantages import group_advantages
from veriroll.coordinator.environments import load_environment
from veriroll.coordinator.loss import async_ppo_loss
from veriroll.coordinator.model_factory import (
    PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    sample_completion_ids,
    warm_start,
)


def evaluate(model, tokenizer, env, *, prompts: int, seed: int) -> dict:
    """Mean reward at T=1 and greedy, on ``prompts`` prompts drawn with a held-out seed."""
    batch = env.sample_prompts(random.Random(10_000 + seed), prompts)
    texts = [p.text for p in batch]
    out = {}
    for key, temperature in (("sampled_reward", 1.0), ("greedy_reward", 0.0)):
        generator = torch.Generator().manual_seed(seed)
        ids = sample_completion_ids(
            model, tokenizer, texts, max_new_tokens=env.max_new_tokens, temperature=temperature, generator=generator
        )
        rewards = [env.reward(p, tokenizer.decode(i, skip_special_tokens=True)) for p, i in zip(batch, ids, strict=True)]
        out[key] = sum(rewards) / len(rewards)
    return out


def completion_logprobs(model, tokenizer, prompt_ids: list[list[int]], completion_ids: list[list[int]]):
    """Log-probs ``[B, T]`` of each completion's tokens under ``model`` and the response mask ``[B, T]``."""
    rows = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (r, p) in enumerate(zip(rows, prompt_ids, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
        mask[i, len(p) - 1 : len(r) - 1] = True  # position t predicts token t + 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp, mask


def rl_to_target(model, tokenizer, env, *, prompts_per_step, group_size, lr, target, max_steps, max_seconds, seed):
    """On-policy GRPO from ``model`` until the mean sampled reward (over the last 3 steps) ≥ ``target``."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    curve: list[float] = []
    started = time.perf_counter()
    steps_to_target = seconds_to_target = None
    for step in range(1, max_steps + 1):
        prompts = [p for p in env.sample_prompts(rng, prompts_per_step) for _ in range(group_size)]
        completions = sample_completion_ids(
            model, tokenizer, [p.text for p in prompts], max_new_tokens=env.max_new_tokens, generator=generator
        )
        rewards = torch.tensor(
            [env.reward(p, tokenizer.decode(c, skip_special_tokens=True)) for p, c in zip(prompts, completions, strict=True)]
        )
        curve.append(rewards.mean().item())
        adv, nonzero = group_advantages(rewards.view(prompts_per_step, group_size))
        keep = nonzero.repeat_interleave(group_size)
        if keep.any():
            model.train()
            prompt_ids = [tokenizer(p.text).input_ids for p, k in zip(prompts, keep.tolist(), strict=True) if k]
            kept = [c for c, k in zip(completions, keep.tolist(), strict=True) if k]
            logp, mask = completion_logprobs(model, tokenizer, prompt_ids, kept)
            loss, _ = async_ppo_loss(
                logp, logp.detach(), adv.flatten()[keep], mask, torch.zeros(len(kept), dtype=torch.long)
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        recent = curve[-3:]
        print(f"rl step {step:3d} reward {curve[-1]:.3f} groups_used {int(nonzero.sum())}", file=sys.stderr)
        if len(recent) == 3 and sum(recent) / 3 >= target:
            steps_to_target, seconds_to_target = step, time.perf_counter() - started
            break
        if time.perf_counter() - started > max_seconds:
            break
    return {
        "steps_to_target": steps_to_target,
        "seconds_to_target": seconds_to_target,
        "final_reward": sum(curve[-3:]) / len(curve[-3:]),
        "curve": [round(r, 4) for r in curve],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-arith", choices=sorted(PRESETS))
    parser.add_argument("--steps", default="25,50,100,150,200", help="warm-start step counts to sweep")
    parser.add_argument("--lr", type=float, default=None, help="warm-start lr (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=None, help="warm-start batch (default: the preset's)")
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--rl", action="store_true", help="also run GRPO from the preset's version 0")
    parser.add_argument("--rl-lr", type=float, default=None, help="RL lr (default: the preset's rl_lr)")
    parser.add_argument("--rl-max-seconds", type=float, default=300.0)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="two step counts, fewer eval prompts")
    args = parser.parse_args()
    torch.set_num_threads(1)

    preset = PRESETS[args.preset]
    env = load_environment(preset.env, **preset.env_kwargs)
    tokenizer = build_char_tokenizer(env.alphabet)
    lr = args.lr if args.lr is not None else preset.warm_start_lr
    batch_size = args.batch_size if args.batch_size is not None else preset.warm_start_batch_size
    step_counts = [int(s) for s in args.steps.split(",")]
    if args.quick:
        step_counts = sorted({step_counts[0], preset.warm_start_steps})
        args.eval_prompts = min(args.eval_prompts, 256)

    sweep = []
    for steps in step_counts:
        model = build_tiny_model(tokenizer, seed=args.seed, **preset.model_kwargs)
        summary = warm_start(model, tokenizer, env, steps=steps, batch_size=batch_size, lr=lr, seed=args.seed)
        row = {"steps": steps, "sft_seconds": round(summary["seconds"], 2), "final_loss": round(summary["final_loss"], 4)}
        row.update({k: round(v, 4) for k, v in evaluate(model, tokenizer, env, prompts=args.eval_prompts, seed=args.seed).items()})
        print(json.dumps(row), file=sys.stderr)
        sweep.append(row)

    result = {
        "preset": args.preset,
        "warm_start_lr": lr,
        "warm_start_batch_size": batch_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sweep": sweep,
    }
    if args.rl:
        result["rl_lr"] = args.rl_lr if args.rl_lr is not None else preset.rl_lr
    if args.rl:
        model = build_tiny_model(tokenizer, seed=args.seed, **preset.model_kwargs)
        warm_start(model, tokenizer, env, steps=preset.warm_start_steps, batch_size=batch_size, lr=lr, seed=args.seed)
        result["rl"] = rl_to_target(
            model,
            tokenizer,
            env,
            prompts_per_step=16,
            group_size=16,
            lr=args.rl_lr if args.rl_lr is not None else preset.rl_lr,
            target=args.target,
            max_steps=10_000,
            max_seconds=args.rl_max_seconds,
            seed=args.seed,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
