"""The benchmark suite behind `benchmarks/bench.py`.

| module | what it holds |
|---|---|
| `options.py` | the command line: modes, prompt sets, batch sizes, K, temperature, placement, device; defaults |
| `machine.py` | what a result was measured on: CPU/GPU, core placement, torch version, git commit |
| `measure.py` | one measurement cell from per-request timings (decode tok/s without prefill, TTFT, TPOT, e2e); peak memory per process |
| `ours.py` | our engine's runners (ar, ar-all, sd, ssd), one engine per mode (per K for ssd) |
| `hf.py` | transformers' runners (hf-ar, hf-assisted) with a timing streamer |
| `isolate.py` | every mode in its own spawned process, progress reported back to one bar |
| `report.py` | the Markdown: headline in the paper's columns, details, Theorem 7, per-round profile |
| `plots.py` | PNGs: tok/s per mode per prompt set, SSD/SD vs batch size, tok/s vs K |
"""
