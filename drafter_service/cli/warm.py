"""`drafter warm`: completed requests from log files into a running service, once or watching folders."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from drafter_service.cli.client_flags import add_client_flags, security_from_args
from drafter_service.service.config import ServiceConfig

if TYPE_CHECKING:
    from drafter_service.ingest.text_tokenizer import TextTokenizer
    from drafter_service.ingest.warm import Warmer, WarmStats

logger = logging.getLogger(__name__)

_DEFAULTS = ServiceConfig()
DEFAULT_STATE_DIR = str(Path(_DEFAULTS.data_dir) / "warm-state")
MAX_BATCH_TOKENS = 1 << 23  # at most 5 bytes per token id: well under the 64 MB message limit


def add_warm_command(sub: argparse._SubParsersAction) -> None:
    """Register ``warm``."""
    from drafter_service.cli.env_flags import env_flag

    wp = sub.add_parser("warm", help="warm a namespace from request logs (JSONL: token ids, text or chat)",
                        description="Send the completed requests of JSONL log files to a running service. Lines "
                        "hold token ids ('prompt' and 'output' lists), text ('prompt' and 'completion'), or chat "
                        "('messages' and the answer as 'response' / 'completion' text, OpenAI 'choices', or a "
                        "last assistant message); text is tokenized with --tokenizer. Requests already stored "
                        "(same request id or content) are skipped, so warming twice adds nothing; progress is "
                        "checkpointed after every acknowledged batch, so a rerun resumes.")
    wp.add_argument("paths", nargs="+", help="log files, or folders whose *.jsonl / *.ndjson files are read")
    env_flag(wp, "--address", str, _DEFAULTS.address, "service address")
    wp.add_argument("--namespace", default="", help="target namespace (default: default)")
    wp.add_argument("--tokenizer", default="", help="the namespace's tokenizer: a tokenizer.json file or a folder "
                    "holding one (and tokenizer_config.json with the chat template); needed for text and chat lines")
    wp.add_argument("--chat-template", default="", help="a Jinja chat template file used instead of the "
                    "tokenizer's own")
    wp.add_argument("--batch-tokens", type=int, default=1 << 18, help="tokens per Ingest call (default %(default)s)")
    wp.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="folder of the checkpoints (default %(default)s)")
    wp.add_argument("--restart", action="store_true", help="ignore checkpoints: read every file from its start "
                    "(requests already stored are still skipped)")
    wp.add_argument("--watch", action="store_true", help="keep running: warm new and grown files every --interval")
    wp.add_argument("--interval", type=float, default=10.0,
                    help="seconds between scans with --watch (default %(default)s)")
    wp.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_client_flags(wp)
    wp.set_defaults(func=run_warm)


def _load_tokenizer(args: argparse.Namespace) -> TextTokenizer | None:
    from drafter_service.ingest.text_tokenizer import TextTokenizer, TokenizerError

    if not args.tokenizer:
        if args.chat_template:
            raise SystemExit("--chat-template needs --tokenizer")
        return None
    try:
        tok = TextTokenizer.load(args.tokenizer)
        if args.chat_template:
            tok = tok.with_chat_template(Path(args.chat_template).read_text(encoding="utf-8"))
    except (TokenizerError, OSError) as exc:
        raise SystemExit(f"bad tokenizer: {exc}") from None
    return tok


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: object) -> None:
        if stop.is_set():  # a second Ctrl-C: stop now (what was acknowledged is checkpointed)
            raise KeyboardInterrupt
        logger.warning("signal %d: stopping after the current batch", signum)
        print("stopping after the current batch (again to stop now)", file=sys.stderr, flush=True)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def run_warm(args: argparse.Namespace) -> int:
    """Warm once, or keep watching with ``--watch``; prints the summary line at the end."""
    from drafter_service.ingest.warm import Warmer, WarmStats, log_files
    from drafter_service.ingest.warm_sinks import GrpcSink, WarmError
    from drafter_service.ingest.warm_state import CheckpointStore

    if not 1 <= args.batch_tokens <= MAX_BATCH_TOKENS or args.interval <= 0:
        raise SystemExit(f"--batch-tokens must be in [1, {MAX_BATCH_TOKENS}] (a batch is one gRPC message) and "
                         "--interval positive")
    tokenizer = _load_tokenizer(args)
    try:
        log_files(args.paths)  # a missing path is reported before connecting
        sink = GrpcSink(args.address, args.namespace, security=security_from_args(args))
    except WarmError as exc:
        raise SystemExit(str(exc)) from None
    if tokenizer is not None and tokenizer.vocab_size > sink.vocab_size:
        logger.warning("the tokenizer has %d ids, the namespace %s only %d: lines with the others are skipped",
                       tokenizer.vocab_size, sink.namespace, sink.vocab_size)
    stop = threading.Event()
    _stop_on_signals(stop)
    warmer = Warmer(sink, tokenizer, CheckpointStore(args.state_dir, sink.target), batch_tokens=args.batch_tokens,
                    stop=stop, progress=not args.no_progress)
    total = WarmStats()
    try:
        if args.watch:
            total = _watch(warmer, args, stop)
        else:
            total = warmer.warm_paths(args.paths, restart=args.restart)
    except WarmError as exc:
        print(f"warming stopped: {exc}; what was acknowledged is checkpointed, run again to resume",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; what was acknowledged is checkpointed, run again to resume", file=sys.stderr)
        return 130
    finally:
        sink.close()
    print(total.summary(), flush=True)
    return 0 if total.requests or total.skipped or not total.malformed else 1


def _watch(warmer: Warmer, args: argparse.Namespace, stop: threading.Event) -> WarmStats:
    """Scan now and every interval until a signal; returns the totals."""
    from apscheduler.schedulers.background import BackgroundScheduler

    from drafter_service.ingest.warm_watch import FolderWatch

    watch = FolderWatch(warmer, args.paths, args.interval)
    if args.restart:  # once from the start, then as usual
        restarted = warmer.warm_paths(args.paths, restart=True)
        watch.total.merge(restarted)
        watch.total.seconds += restarted.seconds
    scheduler = BackgroundScheduler(daemon=True)
    watch.schedule(scheduler)
    scheduler.start()
    print(f"watching {', '.join(args.paths)} every {args.interval:g} s (Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    try:
        while not stop.is_set():  # not stop.wait: the signal handler sets it, and must not find its lock held here
            time.sleep(0.5)
    finally:
        watch.stop()
        scheduler.shutdown(wait=True)
    return watch.total
