"""The whole training state as one flat dict keyed by layout-independent names, and putting it back.

A rank holds one or more model parts (the whole model, or its pipeline stages), each with its own AdamW
and LR schedule (optim.Optimizers). DCP wants one dict per rank whose keys name the same thing on every
layout, so the state is gathered like this:

1. Model: ``get_model_state_dict(part)`` for each part. Stage modules keep the original parameter names
   (``layers.5.attention.wq.weight``) and the state-dict API strips wrapper prefixes (activation
   checkpointing), so the keys are those of the single-device model. Values are what the rank holds: a
   plain tensor on one process, a DTensor shard under FSDP/TP. Keys get the prefix ``model.``.
2. Optimizer: ``get_optimizer_state_dict(part, optimizer, flatten_optimizer_state_dict=True)`` for each
   part. "Flatten" keys the state by parameter name instead of by position in a param group
   (``state.layers.5.attention.wq.weight.exp_avg``, ``param_groups.<name>.lr``), so it does not depend on
   how the parameters were grouped or split into stages. Prefix ``optim.``.
3. The parts hold disjoint parameters, so their dicts merge without collisions (checked). One exception:
   with tied embeddings the weight is saved once, as ``tok_embeddings.weight`` (models/llama.py:
   ``ModelArgs.stored_name``). A whole model's ``output.weight`` is that same Parameter and is left out; a
   pipeline last stage's copy ``output.weight`` (and its Adam state) is offered under the embedding's name,
   so the first and the last stage offer the same key with equal values (mesh/tied_embeddings.py keeps them
   equal) and DCP writes one copy, as for any replicated tensor; a V-schedule rank holding both copies
   offers it once. On load, every ``output.weight`` of a tied model reads ``tok_embeddings.weight``.
4. The rest is small and identical on every rank: ``train.step``, ``train.tokens_consumed`` (the global
   data position), the LR schedule's position and torch's CPU RNG state, as int64/uint8 tensors. Every
   rank offers them under the same key; DCP writes one copy (deduplication) and every rank reads it back.

Loading is the reverse: build the same dict from the freshly built model (it doubles as the list of what
to read, each tensor already sharded for the *new* layout), let ``dcp.load`` fill it in place (each rank
reads only the slices its shards cover, by name and offset), then ``apply_training_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from models.llama import EMBEDDING, HEAD

if TYPE_CHECKING:
    from data.loader import GlobalBatchLoader
    from models.llama import ModelArgs
    from training.optimizer import Optimizers

MODEL, OPTIM, TRAIN = "model.", "optim.", "train."
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
# strict=False: each part is given the merged dict of every part on this rank (pipeline V schedules hold two).
PART_OF_MODEL = StateDictOptions(strict=False)
# The non-tensor-parameter entries every checkpoint has (validated before loading).
TRAIN_KEYS = ("step", "tokens_consumed", "lr_last_epoch", "lr_step_count", "rng_cpu")


def _merge(target: dict, prefix: str, source: dict, shared: frozenset = frozenset()) -> None:
    """Add ``source`` under ``prefix``; a key already present is an error unless it is in ``shared`` (the
    tied embedding's names, held by two parts of a V-schedule rank with equal values: kept once)."""
    for key, value in source.items():
        full = prefix + key
        if full in target and key in shared:
            continue
        if full in target:
            raise ValueError(f"{full} is held by two model parts on this rank; parts must own disjoint parameters")
        target[full] = value


def training_state(parts: list[nn.Module], optimizers: Optimizers, loader: GlobalBatchLoader, step: int) -> dict:
    """This rank's share of the training state after ``step`` optimizer steps: the live tensors, no copy."""
    state: dict = {}
    for part, optimizer in zip(parts, optimizers.optimizers, strict=True):
        args = _args_of(part)
        model_state = stored_names(args, get_model_state_dict(part))
        optim_state = stored_names(args, get_optimizer_state_dict(part, optimizer, options=FLAT_OPTIM))
        tied = args is not None and args.tie_embeddings
        _merge(state, MODEL, model_state, frozenset({EMBEDDING} if tied else ()))
        _merge(state, OPTIM, optim_state, frozenset(k for k in optim_state if tied and _param_of(k) == EMBEDDING))
    scheduler = optimizers.schedulers[0]  # all parts' schedules advance together
    values = {
        "step": step,
        "tokens_consumed": loader.tokens_consumed,
        "lr_last_epoch": scheduler.last_epoch,
        "lr_step_count": scheduler.state_dict()["_step_count"],
    }
    for key, value in values.items():
        state[TRAIN + key] = torch.tensor(value, dtype=torch.int64)
    state[TRAIN + "rng_cpu"] = torch.get_rng_state()
    return state


_OPTIM_PREFIXES = ("state.", "param_groups.")


def _param_of(key: str) -> str | None:
    """The parameter name inside a flattened optimizer key, when it is the tied head or embedding."""
    for prefix in _OPTIM_PREFIXES:
        for name in (EMBEDDING, HEAD):
            if key.startswith(prefix + name + "."):
                return name
    return None


def _args_of(part: nn.Module) -> ModelArgs | None:
    """A part's ModelArgs (None for a module that is not meshloom's Transformer, as some tests train)."""
    return getattr(part, "args", None)


def stored_names(args: ModelArgs | None, entries: dict) -> dict:
    """``entries`` keyed by stored names: a tied ``output.weight`` becomes ``tok_embeddings.weight`` (dropped when the
    part already has that key)."""
    if args is None or not args.tie_embeddings:
        return entries
    out: dict = {}
    for key, value in entries.items():
        if key == HEAD or _param_of(key) == HEAD:
            key = EMBEDDING + key[len(HEAD) :] if key == HEAD else key.replace(HEAD, EMBEDDING, 1)
        out.setdefault(key, value)
    return out


def with_tied_head(args: ModelArgs | None, entries: dict) -> dict:
    """The inverse of ``stored_names`` for loading. Values are copies: two AdamWs sharing one loaded ``exp_avg`` (a
    V-schedule rank's two parts) would update it twice a step."""
    if args is None or not args.tie_embeddings:
        return entries
    out = dict(entries)
    for key, value in entries.items():
        if key == EMBEDDING or _param_of(key) == EMBEDDING:
            copy = value.clone() if isinstance(value, torch.Tensor) else value
            out.setdefault(HEAD if key == EMBEDDING else key.replace(EMBEDDING, HEAD, 1), copy)
    return out


def split(state: dict, prefix: str) -> dict:
    """The entries of ``state`` under ``prefix``, with the prefix removed."""
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


@torch.no_grad()
def apply_training_state(state: dict, parts: list[nn.Module], optimizers: Optimizers, loader: GlobalBatchLoader) -> int:
    """Put a loaded state back into the parts, optimizers, schedules, loader and RNG; returns its step. Every group's LR
    is then set from this run's schedule at the restored position, which may differ from the saved run's."""
    model_state, optim_state = split(state, MODEL), split(state, OPTIM)
    for part, optimizer in zip(parts, optimizers.optimizers, strict=True):
        part_model, part_optim = model_state, optim_state
        args = _args_of(part)
        if getattr(part, "tok_embeddings", True) is None:  # a pipeline last stage's tied copy reads the embedding's
            part_model, part_optim = with_tied_head(args, model_state), with_tied_head(args, optim_state)
        set_model_state_dict(part, part_model, options=PART_OF_MODEL)
        set_optimizer_state_dict(part, optimizer, part_optim, options=FLAT_OPTIM)
    for scheduler in optimizers.schedulers:
        restored = scheduler.state_dict()
        position = int(state[TRAIN + "lr_last_epoch"])
        # LambdaLR's own closed form at the restored position: base LR (this run's) x this run's factor.
        lrs = [base * factor(position) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        restored.update(last_epoch=position, _step_count=int(state[TRAIN + "lr_step_count"]), _last_lr=lrs)
        scheduler.load_state_dict(restored)
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    loader.load_state_dict({"tokens_consumed": int(state[TRAIN + "tokens_consumed"])})
    torch.set_rng_state(state[TRAIN + "rng_cpu"])
    return int(state[TRAIN + "step"])


def expected_entries(model: nn.Module) -> dict[str, torch.Size]:
    """Tensor keys and shapes a checkpoint of ``model`` (the whole single-device model, e.g. on meta) holds."""
    args = model.args
    shapes = {MODEL + name: value.shape for name, value in model.state_dict().items() if args.stored_name(name) == name}
    for name, param in model.named_parameters():  # a tied head is the embedding: named once
        for key in ("exp_avg", "exp_avg_sq"):
            shapes[f"{OPTIM}state.{name}.{key}"] = param.shape
    return shapes
