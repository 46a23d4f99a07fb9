"""Small draft models for the service: built from a target's layers, saved and loaded as transformers checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import pathlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from drafter_service.datasets.cache import atomic_output

if TYPE_CHECKING:
    import numpy as np
    import torch
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

#: File written next to a draft's weights, describing how it was made (:class:`DraftMeta`).
DRAFT_META = "drafter-draft.json"

#: Optional file next to a draft model's weights: (V,) int64 token counts of its training data. The service
#: drafts over the most frequent tokens (``--card-vocab``) and counts them here until its own store is large.
TOKEN_COUNTS = "token_counts.npy"


class DraftModelError(ValueError):
    """A draft model cannot be built or loaded, or does not fit the namespace it is meant for."""


@dataclass(frozen=True)
class DraftMeta:
    """How a draft model was made and how well it agrees with its target.

    Attributes:
        vocab_size: size of the output vocabulary (the namespace's token space).
        target: name or path of the target model it was distilled from.
        num_layers: decoder layers of the draft.
        source_layers: the target layers each draft layer was initialised from.
        initial_draft: the earlier draft this one continued training from (empty: built from the target).
        steps: optimisation steps done.
        tokens_seen: training positions processed.
        agreement_before: top-1 agreement with the target on held-out data before training.
        agreement_after: the same after training.
        agreement_by_source: source name -> top-1 agreement after training.
        kl_before: mean KL(target || draft) per held-out position before training.
        kl_after: the same after training.
        eval_tokens: held-out positions measured.
        draft_step_ms: dtype name -> one decoding step of the draft (batch 1, one token, KV cache), in ms.
        target_step_ms: the same for the target.
        created: ISO 8601 UTC time the file was written.
    """

    vocab_size: int
    target: str
    num_layers: int
    source_layers: list[int] = field(default_factory=list)
    initial_draft: str = ""
    steps: int = 0
    tokens_seen: int = 0
    agreement_before: float | None = None
    agreement_after: float | None = None
    agreement_by_source: dict[str, float] = field(default_factory=dict)
    kl_before: float | None = None
    kl_after: float | None = None
    eval_tokens: int = 0
    draft_step_ms: dict[str, float] = field(default_factory=dict)
    target_step_ms: dict[str, float] = field(default_factory=dict)
    created: str = ""

    def write(self, folder: str | pathlib.Path) -> DraftMeta:
        """Write :data:`DRAFT_META` into ``folder`` atomically; returns what was written (``created`` stamped)."""
        meta = self if self.created else dataclasses.replace(
            self, created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
        path = pathlib.Path(folder) / DRAFT_META
        with atomic_output(path) as tmp:
            tmp.write_text(json.dumps(dataclasses.asdict(meta), indent=1) + "\n")
        return meta

    @classmethod
    def read(cls, folder: str | pathlib.Path) -> DraftMeta | None:
        """The metadata stored in ``folder``, or None when it has none (unknown keys are ignored)."""
        path = pathlib.Path(folder) / DRAFT_META
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def choose_layers(total: int, count: int, layer_choice: str | Sequence[int] = "spread") -> list[int]:
    """The target layers a draft of ``count`` layers starts from.

    Args:
        total: the target's decoder layers.
        count: the draft's decoder layers.
        layer_choice: ``"spread"``: evenly spread, first and last included
            (``round(i * (total - 1) / (count - 1))``; 4 of 30 gives 0, 10, 19, 29); ``"first"``: layers
            ``0 .. count-1``; or explicit indices.

    Raises:
        DraftModelError: on a count outside ``1..total`` or a bad choice.
    """
    if not 1 <= count <= total:
        raise DraftModelError(f"a draft needs 1 to {total} layers (the target's count), got {count}")
    if layer_choice == "spread":
        return [0] if count == 1 else [round(i * (total - 1) / (count - 1)) for i in range(count)]
    if layer_choice == "first":
        return list(range(count))
    if isinstance(layer_choice, str):
        raise DraftModelError(f"unknown layer choice {layer_choice!r} (spread, first or a list of indices)")
    layers = [int(i) for i in layer_choice]
    if len(layers) != count or any(not 0 <= i < total for i in layers):
        raise DraftModelError(f"need {count} layer indices in [0, {total}), got {layers}")
    return layers


def build_draft_from_target(target: PreTrainedModel, num_layers: int,
                            layer_choice: str | Sequence[int] = "spread") -> PreTrainedModel:
    """A draft with the target's architecture and ``num_layers`` decoder layers copied from the target.

    The embeddings, final norm and output head are copied too (tied to each other when the target's are),
    so the draft speaks the target's vocabulary from the start. The target must be Llama-like: decoder
    layers in ``target.model.layers`` and the final norm in ``target.model.norm``.

    Args:
        target: the target causal LM (any dtype; the draft gets the same dtype).
        num_layers: decoder layers of the draft.
        layer_choice: which target layers initialise the draft's (see :func:`choose_layers`).

    Returns:
        A new model of the target's class, in eval mode on the target's device.
    """
    config = copy.deepcopy(target.config)
    layers = choose_layers(config.num_hidden_layers, num_layers, layer_choice)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding / full) follow their layer
        config.layer_types = [config.layer_types[i] for i in layers]
    # transformers wraps PreTrainedModel.to with functools.wraps, which type checkers take for an unbound method
    draft = type(target)(config).to(device=target.device, dtype=target.dtype)  # type: ignore[call-arg]
    body, draft_body = target.model, draft.model
    draft_body.embed_tokens.load_state_dict(body.embed_tokens.state_dict())
    draft_body.norm.load_state_dict(body.norm.state_dict())
    for mine, theirs in zip(draft_body.layers, layers, strict=True):
        mine.load_state_dict(body.layers[theirs].state_dict())
    if not getattr(config, "tie_word_embeddings", False):
        draft.get_output_embeddings().load_state_dict(target.get_output_embeddings().state_dict())
    logger.info("draft of %d layers from target layers %s", num_layers, layers)
    return draft.eval()


def output_vocab_size(model: PreTrainedModel) -> int:
    """How many tokens the model's output head predicts."""
    return int(model.get_output_embeddings().weight.shape[0])


def load_draft_model(path: str | pathlib.Path, vocab_size: int | None = None, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu", namespace: str | None = None) -> PreTrainedModel:
    """Load a draft model saved by ``drafter distill-draft`` or any transformers causal-LM checkpoint folder.

    Args:
        path: folder with ``config.json`` and weights (:data:`DRAFT_META` optional).
        vocab_size: when given, the output vocabulary the model must have.
        dtype: weight dtype (default float32).
        device: where to put it.
        namespace: named in the vocabulary error message.

    Returns:
        The model in eval mode.

    Raises:
        DraftModelError: the folder is missing or unreadable, or the vocabulary differs from ``vocab_size``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder = pathlib.Path(path)
    if not (folder / "config.json").is_file():
        raise DraftModelError(f"no draft model at {folder}: expected a folder with config.json and weights")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise DraftModelError(f"cannot load the draft model at {folder}: {exc}") from exc
    vocab = output_vocab_size(model)
    if vocab_size is not None and vocab != vocab_size:
        where = f"namespace {namespace!r}" if namespace else "the namespace"
        raise DraftModelError(f"draft model at {folder} predicts {vocab} tokens but {where} has vocab_size "
                              f"{vocab_size}")
    return model.to(device).eval()  # type: ignore[arg-type]  # PreTrainedModel.to: see build_draft_from_target


def decode_step_ms(model: PreTrainedModel, context: int = 64, steps: int = 32, warmup: int = 4) -> float:
    """Median time of one greedy decoding step (batch 1, one new token, KV cache), in milliseconds.

    Args:
        model: the causal LM, timed in its own dtype and device.
        context: random prompt tokens prefilled first.
        steps: timed steps.
        warmup: untimed steps first.
    """
    import torch

    from engines.reference.kv_cache import returned_cache, with_cache

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, output_vocab_size(model), (1, context), generator=gen).to(model.device)
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        for i in range(warmup + steps):
            token = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(token, **with_cache(model, returned_cache(out)), use_cache=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


def save_token_counts(folder: str | pathlib.Path, sequences: Sequence[np.ndarray], vocab_size: int,
                      earlier: str | pathlib.Path | None = None) -> None:
    """Write :data:`TOKEN_COUNTS`: how often each token occurs in ``sequences`` (the training data).

    Args:
        earlier: folder of the draft this one continued training (``--init``): its counts are added, since the
            draft learnt from that data too (a draft without counts there adds nothing).
    """
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    earlier_file = pathlib.Path(earlier) / TOKEN_COUNTS if earlier is not None else None
    if earlier_file is not None and earlier_file.is_file():
        before = np.load(earlier_file)[:vocab_size]
        counts[:before.size] += before
    for seq in sequences:
        counts += np.bincount(seq[(seq >= 0) & (seq < vocab_size)], minlength=vocab_size)
    np.save(pathlib.Path(folder) / TOKEN_COUNTS, counts)
