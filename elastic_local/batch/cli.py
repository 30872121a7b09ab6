"""`elastic-local batch IN OUT [DIR]`: a file of prompts run offline with continuous batching."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..cli import add_model_options, load_from_args, whole
from ..paths import default_model

if TYPE_CHECKING:  # the engine (torch) is imported when the command runs, not when `--help` lists it
    from .requests import Job, LineError


def cmd_batch(args: argparse.Namespace) -> int:
    """Run every request of IN and append one OpenAI batch output line per request to OUT.

    IN is OpenAI batch JSONL (custom_id, method, url /v1/chat/completions or /v1/completions, body), JSONL
    with a "prompt" field, or plain text with one prompt per line. Per request, the body may choose
    "think_budget", "answer_budget", "max_think_tokens" and turn thinking off with
    "chat_template_kwargs": {"enable_thinking": false}. A line that cannot run gets an error record and
    the batch goes on. Killed or interrupted, the same command finishes the rest: every custom_id is
    written exactly once.

    elastic-local batch prompts.jsonl answers.jsonl ./ckpt --think-budget small --max-think-tokens 256
    elastic-local batch questions.txt answers.jsonl --dry-run
    """
    from .requests import Checker, Defaults, Job, LineError, check_unique, parse, read_lines

    src, out = Path(args.input), Path(args.output)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: {'a directory, not an' if src.is_dir() else 'no such'} input file")
    if out.exists() and out.resolve() == src.resolve():
        raise ValueError(f"{out}: the output must be another file than the input")
    path = Path(args.dir) if args.dir is not None else default_model()
    defaults = Defaults(args.think_budget, args.answer_budget, args.max_think_tokens, args.max_tokens,
                        not args.no_think)
    items = parse(read_lines(src), Checker.for_checkpoint(path, args.context, defaults).job)
    duplicates = check_unique(items)
    if duplicates:
        raise ValueError(f"{src}: custom_ids must be unique: " + "; ".join(duplicates))
    if args.dry_run:
        return _report(src, items)

    from ..checkpoint.verify import verify_tensors
    from ..model.config import NemotronHConfig
    from .outfile import OutputFile
    from .progress import ProgressBar, Summary
    from .records import error_record, response_record
    from .scheduler import Memory, cache_room, run_jobs

    if any(isinstance(it, Job) for it in items):  # broken weights: an error before OUT is touched
        verify_tensors(path, NemotronHConfig.from_dir(path))
    with OutputFile(out) as f:
        todo = [it for it in items if it.key not in f.done]
        summary = Summary(len(items), len(items) - len(todo))
        if f.repaired:
            print(f"{out}: cut a torn last line ({f.repaired} bytes) left by an interrupted run", file=sys.stderr)
        if f.done and len(todo) == len(items):
            print(f"{out}: holds {len(f.done)} records, none of them for {src}'s requests; appending after them "
                  "(a rerun of the same input resumes; give another OUT to keep the answers apart)", file=sys.stderr)
        if any(isinstance(it, Job) for it in todo):
            model = load_from_args(args, str(path))
            todo = [_resident(it, model.budgets) for it in todo]
        bar = ProgressBar(summary)
        for e in (it for it in todo if isinstance(it, LineError)):
            f.write(error_record(e))
            summary.add(False)
        jobs = [it for it in todo if isinstance(it, Job)]
        try:
            if jobs:
                memory = Memory.of(model, cache_room(model, str(model.device)))
                for job, outcome in run_jobs(model, jobs, args.max_batch, memory, bar.step):
                    if isinstance(outcome, LineError):
                        f.write(error_record(outcome))
                        summary.add(False)
                    else:
                        f.write(response_record(job, outcome, path.name))
                        summary.add(True, outcome.prompt_len, len(outcome.ids) - outcome.prompt_len)
                    bar.show()
        except KeyboardInterrupt:
            summary.interrupted = True
        bar.close()
    print(summary.line(), file=sys.stderr)
    if args.json:
        print(json.dumps(summary.to_dict()))
    return 130 if summary.interrupted else 0


def _resident(it: Job | LineError, budgets: list[str]) -> Job | LineError:
    """A job naming a budget larger than the one loaded (--budget) cannot run."""
    from .requests import Job, LineError

    if isinstance(it, Job):
        for name in (it.request.think_budget, it.request.answer_budget):
            if name is not None and name not in budgets:
                return LineError(it.line, it.custom_id, "unknown_budget",
                                 f"line {it.line}: budget {name!r} is not resident (loaded: {', '.join(budgets)})")
    return it


def _report(src: Path, items: list[Job | LineError]) -> int:
    """--dry-run: what would run, and every bad line."""
    from .requests import Job, LineError

    errors = [it for it in items if isinstance(it, LineError)]
    jobs = [it for it in items if isinstance(it, Job)]
    tokens = sum(len(j.prompt) for j in jobs)
    print(f"{src}: {len(items)} requests, {len(jobs)} valid ({tokens} prompt tokens), {len(errors)} with errors")
    for e in errors:
        print(f"  {e.code}: {e.message}")
    return 1 if errors else 0


def register(sub) -> None:
    p = sub.add_parser("batch", help="run a file of prompts offline (OpenAI batch JSONL or one per line)",
                       description=cmd_batch.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="IN", help="requests: OpenAI batch JSONL, JSONL with 'prompt', or text lines")
    p.add_argument("output", metavar="OUT", help="OpenAI batch output JSONL, appended to (a rerun resumes)")
    p.add_argument("dir", metavar="DIR", nargs="?", help="checkpoint directory (default: the embedded demo model)")
    add_model_options(p)  # --budget is the resident one: requests may name it or a smaller one
    p.add_argument("--think-budget", metavar="NAME", help="budget of the thinking phase (default: largest)")
    p.add_argument("--answer-budget", metavar="NAME", help="budget of the answer phase (default: largest)")
    p.add_argument("--max-think-tokens", type=whole(0), default=1024, metavar="N",
                   help="think token budget of requests that set none (default 1024)")
    p.add_argument("--max-tokens", type=whole(0), default=1024, metavar="N",
                   help="answer token limit of requests that set none (default 1024)")
    p.add_argument("--no-think", action="store_true", help="thinking off for chat requests that do not say")
    p.add_argument("--context", type=whole(1), metavar="N",
                   help="tokens a request may fill, prompt included (default: the model's max_position_embeddings)")
    p.add_argument("--max-batch", type=whole(1), default=32, metavar="N",
                   help="most requests decoding together (default 32; memory may allow fewer, and the "
                        "first jobs' timing one: where one at a time decodes faster, as a tiny model on a CPU may)")
    p.add_argument("--dry-run", action="store_true", help="validate IN and name bad lines; load no model")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.set_defaults(func=cmd_batch)
