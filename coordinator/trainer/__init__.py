"""The asynchronous off-policy trainer: accepted groups in the store → optimizer steps → policy versions.

One step, in the order it happens (``Trainer.step``):

1. **Select.** The accepted groups not yet consumed, oldest first. A group's staleness is
   s = version − group.policy_version, where ``version`` is the policy nodes are told now. Groups with
   s > s_max are dropped (``dropped='stale'``, durably) and never trained on. Up to ``groups_per_step``
   fresh groups make the batch; with fewer than ``min_groups`` the trainer waits (and says so). It never
   waits for a particular node or a whole generation batch: whatever is fresh is what it trains on.
2. **Advantages.** Group-relative (``advantages.group_advantages``); groups whose completions all scored
   the same carry no signal and are skipped, counted, and consumed all the same.
3. **Loss.** ``log_softmax(logits / T)`` of the sampled tokens at positions [P−1, P+T−1) of prompt +
   completion, T the lease temperature (the node's log-probs are at that temperature too), into
   ``loss.async_ppo_loss``. With ``correction='decoupled'`` the PPO ratio is taken against the
   verifier's trusted log-probs; a group that was not verified (no trusted log-probs) falls back to
   'mixed', which is the decoupled form with trusted := behaviour.
4. **Update.** AdamW, gradient-norm clip.
5. **Commit.** One durable transaction marks the consumed groups with the step number, advances kv
   ``trainer_step``, appends the step's diagnostics to kv ``trainer_history`` and, when this step
   publishes, sets kv ``policy_version`` (the new version's files are installed just before).
6. **Checkpoint** the full training state every ``checkpoint_every`` steps (``checkpoint.py``).

Restart: the newest complete training-state checkpoint (step k) is loaded and every group with
``consumed_step > k`` is made unconsumed again, in one transaction with kv ``trainer_step = k``, so
exactly the groups not trained into the restored weights are trained again. Version numbers are never
reused: the next version is one past both kv ``policy_version`` and the newest directory on disk.

Diagnostics are computed where the step computes their ingredients (CleanRL style) and go three
ways: the ``veriroll_trainer{metric=...}`` gauge, one log line, and kv ``trainer_history``.

A step's batch is split into micro-batches (``micro_batch_tokens``) whose gradients add up: each
backpropagates its unnormalized Σ per_token·w, and the summed gradient is divided by the step's
max(Σw, 1) once at the end, so the split changes nothing but the layout.

Sequence packing (``trainer.packing``, on by default): a micro-batch holds up to ``micro_batch_tokens``
real tokens (first-fit, longest sample first; a longer sample gets a row of its own) and its forward lays
the samples end to end in one row (``batch.pack_rows``), position ids restarting at 0 at every sample and
no 2-D mask: transformers' packed-sequence format, in which sdpa and eager attend through a block-diagonal
causal mask built from the position ids, and flash-attention (``attn_implementation`` 'auto' on CUDA with
flash-attn installed) runs its varlen kernel on the cu_seqlens they imply. The log-probs come back per
sample, in the batch's rows, so the loss, masks, advantages and importance weights are untouched. Heavy
tails then cost their real tokens instead of every row padded to its micro-batch's longest. An attention
implementation that cannot confine attention to each sample is refused when the config is loaded and
again when the model is (``check_packing_attention``); ``trainer.packing = false`` is the padded path:
micro-batches of at most ``micro_batch_tokens`` padded tokens (rows × longest row), rows grouped by length.

Memory and numerics: the trainer holds float32 master weights and float32 AdamW state, whatever dtype
version 0 is stored in (``load_training_model``). ``gradient_checkpointing`` recomputes each decoder
layer in the backward (non-reentrant); ``autocast`` runs the forward in bf16 where that pays
(``autocast_dtype``: CUDA by default, never silently on CPU). Measured on SmolLM2-135M on CPU, 8 samples
x 48 tokens, ``micro_batch_tokens`` 1024 (``benchmarks/trainer_memory.py``): peak RSS 3.6 GB with
checkpointing, 4.2 GB without.

Versions are published in ``model_dtype`` (``write_policy_version``): a cast copy of the weights is
written as sharded safetensors next to version 0's tokenizer files, chat template and generation
config, copied byte for byte. The write runs in the trainer's worker thread; shardcast's hashing runs
in a worker thread of the event loop (``publisher.py``); ``measure_publish`` times both.

The same step runs under ``torch.distributed`` (``distributed_train_step``): each rank takes a shard
of the batch's samples, the same accumulation runs per rank, DDP (or FSDP2) averages the gradients and
the all-reduced Σw normalizes them: the update is the single-process update.

The parts, one job each: ``batch.py`` (groups from the store → the step's tensors), ``step.py`` (one optimizer
step), ``distributed.py`` (the same step across ranks), ``device.py`` (where it runs: ``trainer.device``
per rank, the process group's backend, the refusals at start), ``weights.py`` (weights in, versions out) and
``loop.py`` (:class:`Trainer`: select, train, publish, commit, checkpoint, resume). The coordinator's side,
which runs a :class:`Trainer` in a worker thread and announces its versions, is ``app.start_trainer``.
"""

from __future__ import annotations

from veriroll.coordinator.trainer.batch import (
    GroupRecord,
    PackedRow,
    RolloutBatch,
    SampleRecord,
    build_batch,
    load_groups,
    micro_batches,
    pack_rows,
    select_groups,
)
from veriroll.coordinator.trainer.device import (
    check_trainer_device,
    check_trainer_placement,
    check_world_size,
    init_process_group,
    process_group_backend,
    trainer_device,
)
from veriroll.coordinator.trainer.distributed import distributed_train_step, shard_batch, wrap_distributed
from veriroll.coordinator.trainer.loop import HISTORY_CAP, HISTORY_KEY, StepOutcome, Trainer
from veriroll.coordinator.trainer.step import (
    autocast_dtype,
    check_packing_attention,
    completion_logprobs,
    set_gradient_checkpointing,
    train_step,
)
from veriroll.coordinator.trainer.weights import (
    ADAM_BETAS,
    attention_for,
    build_optimizer,
    load_training_model,
    measure_publish,
    write_policy_version,
)

__all__ = [
    "ADAM_BETAS",
    "HISTORY_CAP",
    "HISTORY_KEY",
    "GroupRecord",
    "PackedRow",
    "RolloutBatch",
    "SampleRecord",
    "StepOutcome",
    "Trainer",
    "attention_for",
    "autocast_dtype",
    "build_batch",
    "build_optimizer",
    "check_packing_attention",
    "check_trainer_device",
    "check_trainer_placement",
    "check_world_size",
    "completion_logprobs",
    "distributed_train_step",
    "init_process_group",
    "load_groups",
    "load_training_model",
    "measure_publish",
    "micro_batches",
    "pack_rows",
    "process_group_backend",
    "select_groups",
    "set_gradient_checkpointing",
    "shard_batch",
    "train_step",
    "trainer_device",
    "wrap_distributed",
    "write_policy_version",
]
