"""Offline batch files: OpenAI batch JSONL (or one prompt per line) in, OpenAI batch output out.

    requests.py   IN's lines -> Job (prompt ids + engine Request) | LineError      (no model needed)
    scheduler.py  continuous batching over one Generation, bounded by memory    -> (job, Result)
    records.py    (job, Result) | LineError -> an output line in OpenAI's format
    outfile.py    append-only, locked, torn-line repair, the ids already written (resume)
    progress.py   the progress line and the summary
    cli.py        `elastic-local batch IN OUT [DIR]`
"""
