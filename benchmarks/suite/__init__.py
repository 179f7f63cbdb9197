"""The benchmark suite behind `benchmarks/bench.py`.

| module | what it holds |
|---|---|
| `options.py` | the command line: modes, prompt sets, batch sizes, K, draft weight format, temperature, placement, device; defaults |
| `machine.py` | what a result was measured on: CPU model and kernel flags (ssd_engine.utils.machine), GPU, torch version, git commit |
| `measure.py` | one measurement cell from per-request timings (decode tok/s without prefill, TTFT, TPOT, e2e); peak memory per process |
| `ours.py` | our engine's runners (ar, ar-all, sd, sd-all, ssd, auto), one engine per mode (per K for sd, ssd); rows carry the draft's format and auto's choice |
| `hf.py` | transformers' runners (hf-ar, hf-assisted) with a timing streamer |
| `isolate.py` | every mode in its own process (forked from one server that imported torch once), progress reported back to one bar |
| `report.py` | the Markdown: headline in the paper's columns, details, Theorem 7, per-round profile, SD's round efficiency |
| `goals.py` | the ratio table (SD/AR, SSD/AR, SSD/SD, SSD/ar-all, auto against the fixed modes, SD/hf-assisted, SD round efficiency) and auto's choice |
| `plots.py` | PNGs: tok/s per mode per prompt set, SSD/SD vs batch size, tok/s vs K |
| `dated_report.py` | what the scripts beside bench.py share: --out / --tag / --cores, a child's RESULT line, a report's header, the DATE-NAME[-TAG].md / .json they write |
| `server_process.py` | the serving benchmarks' server processes (bench_server, bench_replicas, serve_bench): a free local port, Ctrl-C then a kill |
"""
