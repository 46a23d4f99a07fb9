"""`drafter import-corpus` and `drafter frozen list|remove`: frozen n-gram tables from corpora, managed live."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from drafter_service.cli.client_flags import add_client_flags, security_from_args
from drafter_service.core.config import DrafterConfig
from drafter_service.service.config import ServiceConfig

logger = logging.getLogger(__name__)

_CORE = DrafterConfig()
_ADDRESS = os.environ.get("DRAFTER_ADDRESS", ServiceConfig().address)


def add_corpus_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``import-corpus`` and ``frozen`` (``list``, ``remove``)."""
    from drafter_service.ingest.corpus_build import DEFAULT_MAX_DISTINCT

    ip = sub.add_parser("import-corpus", help="build a frozen n-gram table from corpus files and send it to a "
                        "running service")
    ip.add_argument("paths", nargs="+", help="text files, folders (read recursively), JSONL files (.jsonl: text, "
                    "chat messages, or prompt/output token ids)")
    ip.add_argument("--name", required=True, help="the table's name in the service (a table of that name is "
                    "replaced)")
    ip.add_argument("--tokenizer", help="tokenizer.json, or a folder holding one (needed for text)")
    ip.add_argument("--namespace", default="", help="target namespace (default: default)")
    ip.add_argument("--address", default=_ADDRESS, help=f"service address [env DRAFTER_ADDRESS; default {_ADDRESS}]")
    ip.add_argument("--leader-capacity", type=int, default=_CORE.leader_capacity, help="most leaders kept (LC)")
    ip.add_argument("--follower-capacity", type=int, default=_CORE.follower_capacity,
                    help="most followers kept per leader (FC)")
    ip.add_argument("--max-distinct", type=int, default=DEFAULT_MAX_DISTINCT,
                    help="most distinct grams held while counting (up to 50 bytes each); beyond it the rarest are "
                    "pruned and the summary says how many")
    ip.add_argument("--field", help="JSONL field holding each document (default: found by itself)")
    ip.add_argument("--roles", help="keep only chat messages of these roles, comma-separated (e.g. assistant; "
                    "ShareGPT's gpt/human count as assistant/user)")
    ip.add_argument("--output", help="also save the table to this .npz file")
    ip.add_argument("--no-upload", action="store_true", help="do not send the table to the service")
    ip.add_argument("--report-json", help="also write the build's figures as JSON to this file")
    add_client_flags(ip)
    ip.set_defaults(func=run_import_corpus)

    fp = sub.add_parser("frozen", help="the frozen tables of a running service").add_subparsers(
        dest="frozen", required=True)
    ls = fp.add_parser("list", help="list a namespace's frozen tables")
    ls.add_argument("--namespace", default="", help="namespace (default: default)")
    ls.add_argument("--address", default=_ADDRESS, help="service address")
    ls.add_argument("--json", action="store_true", help="print JSON")
    add_client_flags(ls)
    ls.set_defaults(func=run_frozen_list)
    rm = fp.add_parser("remove", help="delete a frozen table and stop drafting from it")
    rm.add_argument("name")
    rm.add_argument("--namespace", default="", help="namespace (default: default)")
    rm.add_argument("--address", default=_ADDRESS, help="service address")
    add_client_flags(rm)
    rm.set_defaults(func=run_frozen_remove)


def _rpc_error(exc: Exception, address: str) -> SystemExit:
    code = getattr(exc, "code", lambda: None)()
    details = getattr(exc, "details", lambda: str(exc))()
    return SystemExit(f"service at {address}: {getattr(code, 'name', code)}: {details}")


def run_import_corpus(args: argparse.Namespace) -> int:
    """Build the table (progress bar over bytes read), send it in chunks, print a summary."""
    import grpc
    from tqdm import tqdm

    from drafter_service.ingest.corpus_build import build_corpus_table
    from drafter_service.ingest.corpus_reader import CorpusOptions, corpus_files
    from drafter_service.ingest.text_tokenizer import TextTokenizer, TokenizerError
    from engine_client.admin import put_frozen_table, stats
    from store.frozen_table import save_npz

    if args.no_upload and not args.output and not args.report_json:
        logger.warning("--no-upload without --output: the table is built and dropped")
    namespace_vocab = None
    security = security_from_args(args)
    if not args.no_upload:  # fail before the build when the service or the namespace is not there
        try:
            namespace_vocab = int(stats(args.address, args.namespace, security=security)["vocab_size"])
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.address) from None
    tokenizer = None
    if args.tokenizer:
        try:
            tokenizer = TextTokenizer.load(args.tokenizer)
        except TokenizerError as exc:
            raise SystemExit(str(exc)) from None
        if namespace_vocab is not None and tokenizer.vocab_size > namespace_vocab:
            logger.warning("the tokenizer has %d ids but namespace %r only %d: ids beyond it will be refused",
                           tokenizer.vocab_size, args.namespace or "default", namespace_vocab)
    vocab = tokenizer.vocab_size if tokenizer is not None else (namespace_vocab or 1 << 31)
    roles = frozenset(r.strip() for r in args.roles.split(",") if r.strip()) if args.roles else None
    options = CorpusOptions(field=args.field, roles=roles, vocab_size=namespace_vocab or vocab)
    try:
        total = sum(p.stat().st_size for p in corpus_files(args.paths))
        with tqdm(total=total, desc="reading", unit="B", unit_scale=True, file=sys.stderr) as bar:
            table, report = build_corpus_table(
                args.paths, vocab_size=vocab, encode=tokenizer.encode_batch if tokenizer else None,
                leader_len=_CORE.leader_len, follower_len=_CORE.follower_len,
                leader_capacity=args.leader_capacity, follower_capacity=args.follower_capacity,
                max_distinct=args.max_distinct, options=options, progress=bar.update)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    print("\n".join(report.lines()))
    source = _source(args, tokenizer, report)
    if args.output:
        save_npz(args.output, table, source)
        print(f"saved {args.output}")
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    if args.no_upload:
        return 0
    if len(table) == 0:
        raise SystemExit("the corpus gave no leader-follower pairs: nothing to send")
    t0 = time.perf_counter()
    try:
        with tqdm(total=len(table), desc="sending", unit="leader", file=sys.stderr) as bar:
            info = put_frozen_table(args.address, args.name, table, args.namespace, source, progress=bar.update,
                                    security=security)
    except grpc.RpcError as exc:
        raise _rpc_error(exc, args.address) from None
    print(f"stored frozen table {info['name']!r} in namespace {args.namespace or 'default'!r}: "
          f"{info['leaders']:,} leaders, {info['followers']:,} followers ({time.perf_counter() - t0:.1f} s)")
    return 0


def _source(args: argparse.Namespace, tokenizer: object, report: object) -> str:
    """A description of the corpus kept with the table."""
    names = ", ".join(os.path.basename(os.path.normpath(p)) for p in args.paths)
    tok = f"tokenizer {os.path.basename(os.path.normpath(args.tokenizer))}, " if tokenizer is not None else ""
    text = f"{names} ({tok}{report.documents:,} documents, {report.tokens:,} tokens)"  # type: ignore[attr-defined]
    return text if len(text) <= 1000 else text[:997] + "..."


def run_frozen_list(args: argparse.Namespace) -> int:
    """Print a namespace's frozen tables."""
    import grpc

    from engine_client.admin import list_frozen_tables

    try:
        tables = list_frozen_tables(args.address, args.namespace, security=security_from_args(args))
    except grpc.RpcError as exc:
        raise _rpc_error(exc, args.address) from None
    if args.json:
        print(json.dumps(tables, indent=1))
        return 0
    if not tables:
        print(f"no frozen tables in namespace {args.namespace or 'default'!r}")
    for t in tables:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t["saved_at"]))
        print(f"{t['name']}\t{t['leaders']:,} leaders\t{t['followers']:,} followers\t"
              f"LL={t['leader_len']} FL={t['follower_len']}\tsaved {saved}\t{t['source']}")
    return 0


def run_frozen_remove(args: argparse.Namespace) -> int:
    """Delete a frozen table; exit status 1 when there was none of that name."""
    import grpc

    from engine_client.admin import remove_frozen_table

    try:
        removed = remove_frozen_table(args.address, args.name, args.namespace, security=security_from_args(args))
    except grpc.RpcError as exc:
        raise _rpc_error(exc, args.address) from None
    print(f"removed frozen table {args.name!r}" if removed else f"no frozen table {args.name!r}")
    return 0 if removed else 1
