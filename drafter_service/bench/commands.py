"""The `drafter bench ...` commands: replay against peers, and the store's size and latency at scale."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from drafter_service.bench.batch_bench import add_batch_bench
from drafter_service.bench.corpus_bench import add_corpus_bench
from drafter_service.bench.doc_blocks import DocBlockError, add_doc_flag, parse_targets, write_doc_blocks
from drafter_service.bench.e2e import add_e2e_bench
from drafter_service.bench.first_token import add_first_token_bench
from drafter_service.bench.fleet_bench import add_fleet_bench
from drafter_service.bench.oracle import RetrievalOracle, SeenPrefixes
from drafter_service.bench.proposer_bench import add_proposer_bench
from drafter_service.bench.protocol import ReplayDrafter
from drafter_service.bench.replay import CoreDrafter, Mode, ReplayResult, replay, replay_hindsight
from drafter_service.bench.replay_inputs import PEERS, add_request_flags, chain_peer, load_sets, make_peer, peer_names
from drafter_service.bench.replicas_bench import add_replicas_bench
from drafter_service.bench.serve_bench import add_serve_bench
from drafter_service.bench.soak import add_soak_bench
from drafter_service.bench.step_profile import add_steps_bench
from drafter_service.bench.store_bench import add_store_bench
from drafter_service.bench.vllm_bench import add_vllm_bench
from drafter_service.bench.warm_bench import add_warm_bench
from drafter_service.core.config import GATES, DrafterConfig
from drafter_service.datasets.loaders import DATASET_NAMES, Request, load_dataset, read_requests
from drafter_service.datasets.target_model import smollm2_checkpoint
from store.corpus_counts import build_frozen_table
from store.ngram_table import FrozenNGramTable

logger = logging.getLogger(__name__)

#: drafter with a draft model, by name: (model-free sources on, CARD's correction on).
CARD_VARIANTS = {"drafter+card": (True, True), "drafter+card-nocorr": (True, False), "card-only": (False, True)}

#: ``--draft-model`` value naming SmolLM2-135M-Instruct itself (converted on first use): a draft for the answers of
#: larger models (MT-Bench's vicuna-7b, ShareGPT's ChatGPT); on the ``smollm2-*`` sets it would be the target.
SMOLLM2_DRAFT = "smollm2-135m"


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``bench replay``, ``store``, ``serve``, ``e2e`` and ``corpus`` under the ``bench`` command."""
    bench = sub.add_parser("bench", help="measure acceptance and cost").add_subparsers(dest="bench", required=True)
    rp = bench.add_parser("replay", help="replay completed requests through drafter and peers")
    add_request_flags(rp)
    rp.add_argument("--budget", type=int, action="append", default=[], help="tree budget in nodes (repeatable; "
                    "default 32 unless --chain is given)")
    rp.add_argument("--chain", type=int, action="append", default=[], metavar="K",
                    help="chain mode: each step every drafter proposes one path of at most K tokens, as vLLM "
                    "verifies (repeatable, with or without --budget)")
    rp.add_argument("--no-oracle", action="store_true", help="leave out the retrieval oracle's rows")
    rp.add_argument("--hindsight", action="store_true", help="add the ceiling of choosing among drafter and the "
                    "peers: each step takes whichever of their drafts got the most tokens accepted")
    rp.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated peers among {', '.join(PEERS)}")
    rp.add_argument("--json", help="also write the results as JSON to this file")
    rp.add_argument("--repeat", action="store_true", help="then replay every request a second time (same prompts, "
                    "same outputs) on the same drafters, reported as data set '<name>-repeat'")
    rp.add_argument("--frozen-corpus", help="also run drafter with a frozen table built from the outputs of this "
                    "data set or request file (requests --frozen-skip.. are used, to stay apart from the replay)")
    rp.add_argument("--frozen-skip", type=int, default=0, help="corpus requests skipped first")
    rp.add_argument("--frozen-file", action="append", default=[], help="also run drafter with this frozen table "
                    "(.npz from import-corpus --output or bench corpus --output; repeatable, with --frozen-corpus too)")
    rp.add_argument("--warm-corpus", help="also run drafter and ArcticInference warmed (before the replay) with the "
                    "completed requests [--warm-skip, --warm-skip + --warm-limit) of this data set or request file, "
                    "as `drafter warm` fills a service from logs")
    rp.add_argument("--warm-skip", type=int, default=0, help="warm requests skipped first")
    rp.add_argument("--warm-limit", type=int, default=10000, help="warm requests used")
    rp.add_argument("--frozen-limit", type=int, default=10000, help="corpus requests used")
    rp.add_argument("--draft-model", help="also run drafter with this draft model, a folder or "
                    f"{SMOLLM2_DRAFT} for SmolLM2-135M-Instruct itself (CARD cache: with correction, without it, and "
                    "without model-free sources; --card-variants picks among them)")
    rp.add_argument("--card-variants", default=",".join(CARD_VARIANTS),
                    help="with --draft-model, which of its drafters run (comma-separated subset of "
                    f"{', '.join(CARD_VARIANTS)})")
    rp.add_argument("--draft-threads", type=int, default=2, help="torch threads of the draft model")
    rp.add_argument("--card-width", type=int, default=16, help="K of the draft model's cache")
    rp.add_argument("--card-top-k", type=int, default=4, help="k of the draft model's cache")
    rp.add_argument("--card-layers", type=int, default=6,
                    help="layers the draft model grows per verification step (the communication ratio)")
    rp.add_argument("--card-vocab", type=int, default=8192, help="draft over this many of the most frequent tokens")
    add_doc_flag(rp)
    rp.add_argument("--card-gate", choices=GATES, default="acceptance",
                    help="when the model's nodes are served (drafter serve's --card-gate; the replay's default "
                    "weighs acceptance alone, since time does not count in it)")
    rp.set_defaults(func=run_replay)
    add_store_bench(bench)
    add_serve_bench(bench)
    add_batch_bench(bench)
    add_proposer_bench(bench)
    add_warm_bench(bench)
    add_e2e_bench(bench)
    add_steps_bench(bench)
    add_vllm_bench(bench)
    add_corpus_bench(bench)
    add_soak_bench(bench)
    add_replicas_bench(bench)
    add_fleet_bench(bench)
    add_first_token_bench(bench)


def _oracles(reqs: Sequence[Request], passes: int, warm: Sequence[Request] | None,
             max_len: int) -> list[tuple[SeenPrefixes, int, str]]:
    """The retrieval oracle's lengths over the replay (``passes`` times ``reqs``), and over the warm corpus then the
    replay when there is one: (lengths, requests of history to skip, row name)."""
    out = [(SeenPrefixes.of(list(reqs) * passes, max_len), 0, "oracle")]
    if warm is not None:
        out.append((SeenPrefixes.of(list(warm) + list(reqs) * passes, max_len), len(warm), "oracle+warm"))
    return out


def card_variants(spec: str) -> list[str]:
    """The draft-model drafters named in ``--card-variants``, in ``CARD_VARIANTS`` order."""
    names = {n.strip() for n in spec.split(",") if n.strip()}
    unknown = names - set(CARD_VARIANTS)
    if unknown or not names:
        raise SystemExit(f"--card-variants takes a comma-separated subset of {', '.join(CARD_VARIANTS)}; "
                         f"got {spec!r}")
    return [n for n in CARD_VARIANTS if n in names]


def run_replay(args: argparse.Namespace) -> int:
    """Replay each data set through drafter, every peer and the retrieval oracle at every budget and chain length;
    print one table."""
    rows: list[tuple[Mode, int]] = [("tree", b) for b in args.budget] + [("chain", k) for k in args.chain]
    rows = rows or [("tree", 32)]
    if any(n < 1 for _, n in rows):
        raise SystemExit("--budget and --chain must be at least 1")
    try:
        parse_targets(args.write_doc)
    except DocBlockError as exc:
        raise SystemExit(str(exc)) from None
    peers = peer_names(args.peers)
    card_variants(args.card_variants)  # a bad list fails before anything loads
    frozen = {args.frozen_corpus: _frozen_table(args)} if args.frozen_corpus else {}
    for path in args.frozen_file:
        frozen[pathlib.Path(path).stem] = _frozen_file(path)
    warm = _corpus(args.warm_corpus, args.warm_skip, args.warm_limit) if args.warm_corpus else None
    passes = 2 if args.repeat else 1
    results: list[ReplayResult] = []
    for name, reqs in load_sets(args):
        oracles = [] if args.no_oracle else _oracles(reqs, passes, warm, max(n for _, n in rows))
        for mode, budget in rows:
            new_peer = chain_peer if mode == "chain" else make_peer
            drafters: list[ReplayDrafter] = [CoreDrafter()]
            if frozen:
                with_frozen = CoreDrafter(name="drafter+frozen")
                for table_name, table in frozen.items():
                    with_frozen.core.add_frozen(table_name, table)
                drafters.append(with_frozen)
            if args.draft_model:
                drafters += _card_drafters(args, reqs)
            drafters += [d for d in map(new_peer, peers) if d is not None]
            if warm is not None:
                drafters += _warmed_drafters(peers, warm, new_peer)
            drafters += [RetrievalOracle(seen, skip, oracle) for seen, skip, oracle in oracles]
            for drafter in drafters:
                for label in (name, f"{name}-repeat") if args.repeat else (name,):
                    with tqdm(total=len(reqs), desc=f"{label} {mode} {budget} {drafter.name}", unit="req",
                              file=sys.stderr, leave=False) as bar:
                        results.append(replay(drafter, reqs, budget, label, progress=lambda _: bar.update(),
                                              mode=mode))
            if args.hindsight:
                chosen = [CoreDrafter(), *(d for d in map(new_peer, peers) if d is not None)]
                with tqdm(total=len(reqs), desc=f"{name} {mode} {budget} hindsight", unit="req", file=sys.stderr,
                          leave=False) as bar:
                    results.append(replay_hindsight(chosen, reqs, budget, name, progress=lambda _: bar.update(),
                                                    mode=mode))
    print(format_table(results))
    if args.write_doc:
        write_doc_blocks(args.write_doc, format_headline(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)
    return 0


def _card_drafters(args: argparse.Namespace, reqs: Sequence[Request]) -> list[ReplayDrafter]:
    """drafter with the draft model, as ``--card-variants`` names them: CARD with correction, without it
    (ablation), and the model alone."""
    import torch

    from drafter_service.core.config import CardSettings
    from drafter_service.model.card import DraftModelDrafts
    from drafter_service.model.draft_model import load_draft_model

    torch.set_num_threads(args.draft_threads)
    vocab = max(int(max(r.prompt.max(initial=0), r.output.max(initial=0))) for r in reqs) + 1
    folder = str(smollm2_checkpoint()) if args.draft_model == SMOLLM2_DRAFT else args.draft_model
    model = load_draft_model(folder)
    if vocab > model.config.vocab_size:
        raise SystemExit(f"the requests hold token id {vocab - 1}, beyond the draft model's vocabulary")
    out: list[ReplayDrafter] = []
    for name in card_variants(args.card_variants):
        model_free, correction = CARD_VARIANTS[name]
        settings = CardSettings(width=args.card_width, top_k=args.card_top_k, layers_ahead=args.card_layers,
                                correction=correction, max_sessions=1, vocab=args.card_vocab,
                                gate=args.card_gate)
        sources = {f"use_{s}": model_free for s in ("session", "store", "dynamic", "frozen")}
        drafts = DraftModelDrafts(model, settings, _token_counts(folder))
        out.append(CoreDrafter(DrafterConfig(**sources), name, drafts))
    return out


def _token_counts(folder: str) -> np.ndarray | None:
    from drafter_service.model.draft_model import TOKEN_COUNTS

    path = pathlib.Path(folder) / TOKEN_COUNTS
    return np.load(path) if path.is_file() else None


def _corpus(source: str, skip: int, limit: int) -> list[Request]:
    """Requests [skip, skip + limit) of a data set or request file."""
    stop = skip + limit
    reqs = load_dataset(source, stop)[skip:stop] if source in DATASET_NAMES else list(read_requests(source))[skip:stop]
    if not reqs:
        raise SystemExit(f"no requests in {source} after skipping {skip}")
    return reqs


def _warmed_drafters(peers: Sequence[str], warm: Sequence[Request],
                     make_peer: Callable[[str], ReplayDrafter | None] = make_peer) -> list[ReplayDrafter]:
    """drafter, and ArcticInference when it is among the peers (made by ``make_peer``), filled with ``warm`` before
    the replay.

    drafter takes them as the service's Ingest does (store, dynamic table, repeated-prompt cache, then an index
    rebuild); a peer sees each as a request it served (start, extend with the whole output, end).
    """
    ours = CoreDrafter(name="drafter+warm")
    for req in warm:
        ours.core.add_document(np.concatenate([req.prompt, req.output]), prompt_len=int(req.prompt.size))
    ours.core.store.rebuild("main")
    out: list[ReplayDrafter] = [ours]
    for name in peers:
        if not name.startswith("arctic"):
            continue
        peer = make_peer(name)
        if peer is None:
            continue
        peer.name = f"{peer.name}+warm"
        for i, req in enumerate(warm):
            peer.start(f"warm-{i}", req.prompt.tolist())
            peer.extend(f"warm-{i}", req.output.tolist())
            peer.end(f"warm-{i}")
        out.append(peer)
    return out


def _frozen_file(path: str) -> FrozenNGramTable:
    """A frozen table saved as .npz by import-corpus or bench corpus."""
    from store.frozen_table import load_npz

    try:
        table, source = load_npz(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read frozen table {path}: {exc}") from None
    logger.warning("frozen table %s: %d leaders, %d followers (%s)", path, len(table), table.followers, source)
    return table


def _frozen_table(args: argparse.Namespace) -> FrozenNGramTable:
    """Frozen table from the outputs of corpus requests [skip, skip + limit)."""
    source = args.frozen_corpus
    reqs = _corpus(source, args.frozen_skip, args.frozen_limit)
    t0 = time.perf_counter()
    cfg = DrafterConfig()
    table = build_frozen_table((r.output for r in reqs), cfg.leader_len, cfg.follower_len,
                                   cfg.leader_capacity, cfg.follower_capacity)
    logger.warning("frozen table from %d %s outputs (%d tokens): %d leaders in %.1f s", len(reqs), source,
                   sum(r.output.size for r in reqs), len(table), time.perf_counter() - t0)
    return table


def _is_ours(name: str) -> bool:
    return name.startswith("drafter")


def _warmed(name: str) -> bool:
    return name.endswith("+warm")


def _is_oracle(name: str) -> bool:
    return name.startswith("oracle")


def format_headline(results: Sequence[ReplayResult]) -> str:
    """The README's table: per data set and budget, drafter's MAT (with a frozen table where one ran) against the
    best peer's."""
    groups: dict[tuple[str, str], list[ReplayResult]] = {}
    for r in results:
        if not _warmed(r.drafter) and not _is_oracle(r.drafter) and not _is_hindsight(r.drafter):
            groups.setdefault((r.dataset, r.label), []).append(r)
    frozen = any(r.drafter == "drafter+frozen" for r in results)
    lines = ["| data set | budget | drafter | " + ("drafter+frozen | " if frozen else "")
             + "best peer | drafter vs best peer |", "|---|---|---|" + ("---|" if frozen else "") + "---|---|"]
    for (dataset, label), rs in groups.items():
        by = {r.drafter: r for r in rs}
        peers = [r for r in rs if not _is_ours(r.drafter)]
        if "drafter" not in by:
            continue
        ours = by["drafter"].mat
        best = max(peers, key=lambda r: r.mat) if peers else None
        cells = [dataset, label, f"{ours:.3f}"]
        if frozen:
            cells.append(f"{by['drafter+frozen'].mat:.3f}" if "drafter+frozen" in by else "")
        cells += [f"{best.mat:.3f} ({best.drafter})" if best else "-", f"{ours / best.mat:.2f}×" if best else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _is_hindsight(name: str) -> bool:
    return name.startswith("hindsight(")


def format_table(results: Sequence[ReplayResult]) -> str:
    """Markdown table, one row per result; rows compare within the same data set, mode and budget (or chain length),
    warmed variants with warmed peers and oracle, the others with the cold ones.

    ``vs best peer`` is drafter's MAT over the best peer's (and the hindsight choice's, which is no peer).
    ``share of oracle`` is ``(MAT - 1) / (oracle MAT - 1)``: the share of the draft tokens the retrieval oracle gets
    accepted that the row gets accepted.
    """
    best: dict[tuple[str, str, int, bool], float] = {}
    oracle: dict[tuple[str, str, int, bool], float] = {}
    for r in results:
        key = (r.dataset, r.mode, r.budget, _warmed(r.drafter))
        if _is_oracle(r.drafter):
            oracle[key] = r.mat
        elif not _is_ours(r.drafter) and not _is_hindsight(r.drafter):
            best[key] = max(best.get(key, 0.0), r.mat)
    lines = ["| data set | budget | drafter | MAT | vs best peer | share of oracle | steps with a hit | nodes/step | "
             "p50 µs | p99 µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        key = (r.dataset, r.mode, r.budget, _warmed(r.drafter))
        peer, ceiling = best.get(key), oracle.get(key)
        compared = _is_ours(r.drafter) or _is_hindsight(r.drafter)
        ratio = f"{r.mat / peer:.2f}×" if compared and peer else ""
        share = f"{(r.mat - 1) / (ceiling - 1):.1%}" if ceiling and ceiling > 1 and not _is_oracle(r.drafter) else ""
        knows_answer = _is_oracle(r.drafter) or _is_hindsight(r.drafter)
        latency = ["", ""] if knows_answer else [f"{r.p50_us:.0f}", f"{r.p99_us:.0f}"]
        cells = [r.dataset, r.label, r.drafter, f"{r.mat:.3f}", ratio, share, f"{r.hit_rate:.1%}",
                 f"{r.mean_nodes:.1f}", *latency]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n{r.dataset} b={r.label} {r.drafter}: draft model cache hit rate {r.model_hit_rate:.1%} of its steps"
              for r in results if r.model_hit_rate is not None]
    return "\n".join(lines)
