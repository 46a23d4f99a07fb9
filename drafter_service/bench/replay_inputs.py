"""What replays of recorded requests share: the request flags and sets, and the peers by name."""

from __future__ import annotations

import argparse
import logging

from drafter_service.bench.ngram_mod import NGramModDrafter
from drafter_service.bench.peers import ArcticSuffixDrafter, PromptLookupDrafter, arctic_available
from drafter_service.bench.pia_trie import PiaLookaheadDrafter
from drafter_service.bench.protocol import ReplayDrafter
from drafter_service.datasets.loaders import DATASET_NAMES, Request, load_dataset, read_requests

logger = logging.getLogger(__name__)

__all__ = ["PEERS", "add_request_flags", "chain_peer", "load_sets", "make_peer", "peer_names"]

#: The model-free peers a replay can run, by name.
PEERS = ("prompt-lookup", "arctic", "arctic-f4", "pia", "ngram-mod")


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """The requests replayed: files, ``--dataset`` (repeatable), ``--limit`` and ``--skip`` (read by ``load_sets``)."""
    parser.add_argument("files", nargs="*", help="request JSONL files (request_id, prompt, output token ids)")
    parser.add_argument("--dataset", action="append", default=[], choices=DATASET_NAMES,
                        help="a built-in data set, tokenized with SmolLM2's tokenizer (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="requests per data set (default: each set's own)")
    parser.add_argument("--skip", type=int, default=0, help="requests skipped first in each data set")


def load_sets(args: argparse.Namespace) -> list[tuple[str, list[Request]]]:
    """The data sets and request files ``add_request_flags`` named, each cut to ``[skip, skip + limit)``.

    Raises:
        SystemExit: on a negative ``--skip``, or when no set or file is named.
    """
    if args.skip < 0:
        raise SystemExit("--skip must be >= 0")
    stop = None if args.limit is None else args.skip + args.limit
    sets = [(name, load_dataset(name, stop)[args.skip:]) for name in args.dataset]
    for path in args.files:
        sets.append((path, list(read_requests(path))[args.skip:stop]))
    if not sets:
        raise SystemExit("give request files or --dataset NAME")
    return sets


def peer_names(spec: str) -> list[str]:
    """The peers of a comma-separated ``--peers`` list, in its order.

    Raises:
        SystemExit: on a name outside ``PEERS``.
    """
    names = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer {unknown[0]!r}; choose among {', '.join(PEERS)}")
    return names


def make_peer(name: str) -> ReplayDrafter | None:
    """A fresh peer in tree mode; None (with a warning) for ArcticInference when it is not installed.

    Raises:
        SystemExit: on an unknown name.
    """
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name in ("arctic", "arctic-f4"):
        if not arctic_available():
            logger.warning("arctic-inference is not installed (make bench-peers); skipping %s", name)
            return None
        return ArcticSuffixDrafter(max_spec_factor=4.0 if name == "arctic-f4" else 1.0)
    if name == "pia":
        return PiaLookaheadDrafter()
    if name == "ngram-mod":
        return NGramModDrafter()
    raise SystemExit(f"unknown peer {name!r}; choose among {', '.join(PEERS)}")


def chain_peer(name: str) -> ReplayDrafter | None:
    """A peer in chain mode: ArcticInference as vLLM's ``suffix`` method runs it, the others as in tree mode."""
    if name in ("arctic", "arctic-f4") and arctic_available():
        return ArcticSuffixDrafter.vllm_suffix(max_spec_factor=4.0 if name == "arctic-f4" else 1.0)
    return make_peer(name)
