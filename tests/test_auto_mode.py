"""speculative_mode="auto": the throughput predictions (planning/predict.py), the cached cost
measurement (planning/costs.py) and the choice applied to a real engine (planning/choose.py)."""

from dataclasses import replace

import pytest
from test_speculative_decoding import GREEDY, _prompts, greedy_oracle, noisy_draft, target  # noqa: F401 (fixtures)

from ssd_engine import LLM
from ssd_engine.distributed.placement import available_cores
from ssd_engine.engine.execution import PER_STEP_NOTE
from ssd_engine.planning import choose, mode_placement, survey
from ssd_engine.planning.costs import MeasuredCosts, _curve
from ssd_engine.planning.plan import plan
from ssd_engine.planning.predict import (
    Acceptance,
    Costs,
    Prediction,
    predict_all,
    predict_sd,
    predict_ssd,
)
from ssd_engine.saguaro.calibration import Calibration
from ssd_engine.saguaro.fanout import outcome_probabilities


def _calibration(probs: list[float]) -> Calibration:
    return Calibration(
        "t",
        "d",
        0.0,
        len(probs) - 1,
        alpha=0.7,
        outcome_probs=probs,
        r=1.0,
        miss_coeff=0.3,
        miss_by_fanout=[0.3, 0.15, 0.1],
        budget=4,
        budget_fits=4,
        t_p=1.0,
        e_primary=3.0,
        e_fast=1.2,
        p_hit=0.7,
    )


def test_acceptance_reproduces_the_calibrated_outcome_law_and_extends_it():
    measured = [
        0.156,
        0.1743,
        0.1284,
        0.0367,
        0.5046,
    ]  # the default pair's, at K = 4: whole runs are likely
    acc = Acceptance.from_calibration(_calibration(measured))
    assert acc.outcome_probs(4) == pytest.approx(measured, abs=1e-9)
    assert acc.tokens_per_round(4) == pytest.approx(
        sum((j + 1) * p for j, p in enumerate(measured))
    )
    assert sum(acc.outcome_probs(8)) == pytest.approx(1.0)
    assert acc.tokens_per_round(1) < acc.tokens_per_round(4) < acc.tokens_per_round(8)
    iid = Acceptance.from_calibration(_calibration(outcome_probabilities(0.6, 3)))
    assert iid.outcome_probs(6) == pytest.approx(
        outcome_probabilities(0.6, 6)
    )  # i.i.d. stays i.i.d.
    assert iid.miss(0) == 1.0 and iid.miss(2) == 0.15 and iid.miss(6) == pytest.approx(0.1 * 3 / 6)


def _costs(target_s: float, draft_s: float, ssd: bool = True) -> Costs:
    target = lambda rows: (
        target_s * (1 + 0.05 * (rows - 1))
    )  # verification barely costs more than a step
    draft = lambda rows: draft_s * (1 + 0.5 * (rows - 1))
    return Costs(
        target, lambda rows: 1.6 * target(rows), draft, lambda rows: 1.3 * draft(rows), ssd
    )


ACC = Acceptance.from_calibration(_calibration([0.156, 0.1743, 0.1284, 0.0367, 0.5046]))


def test_a_cheap_draft_beats_ar_and_an_expensive_one_does_not():
    cheap = predict_all(_costs(0.4, 0.02), ACC)
    assert cheap["sd"].tokens_per_s > 2 * cheap["ar"].tokens_per_s and cheap["sd"].k >= 3
    assert cheap["ssd"].tokens_per_s > cheap["ar"].tokens_per_s
    costly = predict_all(_costs(0.4, 0.4), ACC)
    assert max(costly["sd"].tokens_per_s, costly["ssd"].tokens_per_s) < costly["ar"].tokens_per_s
    assert "ssd" not in predict_all(_costs(0.4, 0.02, ssd=False), ACC)


def test_the_smallest_k_near_the_best_wins():
    preds = predict_all(_costs(0.4, 0.02), ACC)
    every = [predict_sd(_costs(0.4, 0.02), ACC, k).tokens_per_s for k in range(1, 9)]
    assert preds["sd"].tokens_per_s >= 0.97 * max(every)
    assert all(every[k - 1] < 0.97 * max(every) for k in range(1, preds["sd"].k))


def test_sd_round_is_one_verification_plus_k_draft_steps():
    costs = _costs(0.4, 0.02)
    p = predict_sd(costs, ACC, 4)
    assert p.detail["round_s"] == pytest.approx(costs.target_all(5) + 4 * costs.draft_all(1))
    assert p.tokens_per_s == pytest.approx(ACC.tokens_per_round(4) / p.detail["round_s"])


def test_ssd_budget_is_the_largest_build_inside_one_verification():
    from ssd_engine.speculative.ssd.draft.build_budget import HEADROOM

    costs = _costs(0.4, 0.02)
    p = predict_ssd(costs, ACC, 4)
    window = HEADROOM * costs.target_one(5)  # as the run-time budget aims
    build = lambda b: costs.draft_one(5) + 4 * costs.draft_one(b)
    assert build(p.detail["budget"]) <= window < build(p.detail["budget"] + 1)
    assert sum(p.detail["fanout"]) == p.detail["budget"] and p.detail["t_p"] <= 1
    assert p.detail["floor_t_p"] == pytest.approx(build(1) / costs.target_one(5))
    assert 0 < p.detail["p_hit"] <= 1


def test_ssd_draft_format_is_the_fastest_and_near_ties_go_to_the_smaller_floor():
    fast, flat = (
        Prediction("ssd", 4, 10.0, {"floor_t_p": 0.9}),
        Prediction("ssd", 4, 9.9, {"floor_t_p": 0.6}),
    )
    assert choose._best_format([("bf16", fast), ("int4", flat)]).detail["draft_format"] == "int4"
    slow = Prediction("ssd", 4, 8.0, {"floor_t_p": 0.5})
    picked = choose._best_format([("bf16", fast), ("int4", slow)])
    assert picked.detail["draft_format"] == "bf16" and picked.tokens_per_s == 10.0


def test_cost_curves_interpolate_and_extend():
    curve = _curve({1: 1.0, 3: 2.0, 5: 4.0})
    assert (curve(1), curve(2), curve(5), curve(7)) == (1.0, 1.5, 4.0, 6.0)
    assert _curve({1: 0.3})(9) == 0.3
    assert (
        _curve({1: 2.0, 5: 1.0, 9: 3.0})(1) == 1.0
    )  # a noisy first point cannot exceed a later one


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_ENGINE_CACHE", str(tmp_path))
    return tmp_path


def test_auto_measures_once_then_reuses_and_stays_exact(target, noisy_draft, private_cache):
    oracle = greedy_oracle(target)[:3]
    with LLM(target, draft_model=noisy_draft, num_threads=1, block_size=8) as llm:
        choice = llm.engine.plan.choice
        assert llm.config.speculative.mode == "auto" and llm.engine.plan.mode == choice.mode
        assert choice.mode in ("ar", "sd", "ssd") and not choice.how.startswith("cached")
        assert set(choice.predicted_tok_s) >= {"ar", "sd"} and choice.describe().startswith(
            choice.mode
        )
        choice_each_step = llm.engine.step_choice is not None
        per_step = PER_STEP_NOTE.format(k=llm.engine.k) if choice_each_step else ""
        assert llm.engine.execution()["mode"] == choice.describe() + per_step
        assert [o.token_ids for o in llm.generate(_prompts(3), GREEDY, use_tqdm=False)] == oracle
    (stored,) = (private_cache / "calibrations").iterdir()
    assert MeasuredCosts.load(str(stored)).target_all[1] > 0
    with LLM(target, draft_model=noisy_draft, num_threads=1, block_size=8) as again:
        assert (
            again.engine.plan.choice.how.startswith("cached")
            and again.engine.plan.choice.mode == choice.mode
        )


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_each_choice_is_applied_whole(target, noisy_draft, private_cache, monkeypatch, mode):
    """Whatever the prediction says, the engine runs that mode with its K, format, cores and budget."""
    fixed = {
        "ar": Prediction("ar", 0, 1.0),
        "sd": Prediction("sd", 2, 1.0 + (mode == "sd")),
        "ssd": Prediction(
            "ssd", 3, 1.0 + 2 * (mode == "ssd"), {"budget": 5, "t_p": 0.8, "t_jit": 0.3}
        ),
    }
    # two of this process's cores, whatever the host has: the planned sets are then known (a, b)
    first, second = (available_cores() + [None])[:2]
    if second is None:
        pytest.skip("needs two cores")
    monkeypatch.setattr(mode_placement, "available_cores", lambda: [first, second])
    monkeypatch.setattr(
        survey, "load_or_measure", lambda *args, **_: (_fake_costs(args[-1].ssd_draft), False)
    )
    monkeypatch.setattr(choose, "predict_all", lambda costs, acc: fixed)
    with LLM(target, draft_model=noisy_draft, block_size=8, draft_dtype="int8") as llm:
        resolved = llm.engine.config
        assert resolved.speculative.mode == mode and llm.engine.plan.choice.mode == mode
        outs = llm.generate(_prompts(3), GREEDY, use_tqdm=False)
        if mode == "ssd":
            assert (
                llm.engine.k == resolved.speculative.k == 3 and resolved.speculative.ssd.budget == 5
            )
            assert (
                resolved.parallel.cpu_cores == f"{first};{second}"
                and llm.engine.plan.draft_format.name == "int8"
            )
            prior = (
                llm.engine.speculator.policy.prior
            )  # the fallback rule starts from this machine's timing
            assert (prior.t_p, prior.t_slow) == (0.8, 0.3)
        elif mode == "sd":
            # the predicted K first, one more for the per-step choice to measure
            assert llm.engine.k == 3 and llm.engine.step_choice.start == 2
            assert resolved.parallel.cpu_cores == f"{first},{second}"
            assert resolved.model.num_threads == 2
            assert llm.engine.plan.draft_format.name == "int8"
        else:
            assert (
                llm.engine.speculator is None
                and llm.engine.k == 0
                and resolved.model.num_threads == 2
            )
    assert [o.token_ids for o in outs] == greedy_oracle(target)[:3]


def test_a_near_tie_goes_to_ar(target, noisy_draft, private_cache, monkeypatch):
    fixed = {"ar": Prediction("ar", 0, 1.0), "sd": Prediction("sd", 2, 1.04)}
    monkeypatch.setattr(
        survey, "load_or_measure", lambda *args, **_: (_fake_costs(args[-1].ssd_draft), False)
    )
    monkeypatch.setattr(choose, "predict_all", lambda costs, acc: fixed)
    with LLM(target, draft_model=noisy_draft, block_size=8) as llm:
        assert llm.engine.plan.mode == "ar"


def test_a_forced_ssd_is_sized_from_this_machine(target, noisy_draft, private_cache):
    with LLM(target, draft_model=noisy_draft, speculative_mode="ssd", block_size=8) as llm:
        choice, budget = llm.engine.plan.choice, llm.engine.config.speculative.ssd.budget
        assert choice.how.startswith("forced") and budget == choice.detail["budget"] >= 1
        assert sum(llm.engine.speculator.plan.fanouts[0][1]) == budget
    with LLM(
        target, draft_model=noisy_draft, speculative_mode="ssd", ssd_budget=2, block_size=8
    ) as pinned:
        assert (
            pinned.engine.plan.choice is None and pinned.engine.config.speculative.ssd.budget == 2
        )
    # nothing left to size (a fan-out, a draft format, a fallback needing no timing): nothing measured
    with LLM(
        target,
        draft_model=noisy_draft,
        speculative_mode="ssd",
        ssd_fanout=1,
        draft_dtype="fp32",
        ssd_fallback="jit",
        block_size=8,
    ) as given:
        assert given.engine.plan.choice is None


def test_memory_traffic_streams_on_the_given_cores_and_stops_with_the_block():
    import os

    from ssd_engine.planning.contention import memory_traffic

    core = sorted(os.sched_getaffinity(0))[-1]
    with memory_traffic([core]) as pid:
        assert os.sched_getaffinity(pid) == {core}
    assert not os.path.exists(f"/proc/{pid}")  # reaped, not left running


# ---- tensor parallelism and other devices ----------------------------------------------------------
def _two_cores() -> tuple[str, list[int]]:
    """Two of this process's cores as one per rank: what `--tp 2` gets on a 2-core machine."""
    import os

    cores = sorted(os.sched_getaffinity(0))[:2]
    return f"{cores[0]};{cores[1]}", cores


def _fake_costs(draft_cores: list[int], fmt: str = "int8") -> MeasuredCosts:
    """Costs that skip measuring (tests that fix the predictions, or check only the placement)."""
    curve = {1: 0.1, 5: 0.12, 9: 0.14}
    return MeasuredCosts(
        "fake",
        [0],
        draft_cores,
        curve,
        curve,
        {1: 0.01},
        {fmt: {1: 0.01, 9: 0.02, 32: 0.05}},
        fmt,
        fmt,
        0.0,
    )


def test_tp_auto_predicts_from_measured_ranks_and_never_runs_a_shared_draft(
    target, noisy_draft, private_cache
):
    """tp=2 on two cores: the ranks take one core each, so SSD's draft would share them and is no
    candidate; the target is measured on its two ranks, the choice is the faster prediction of AR
    and SD (by the 5% rule), applied on the ranks' cores, and its output is exact. An `auto` that
    still ran SSD under TP fails here."""
    cpu_cores, cores = _two_cores()
    with LLM(
        target, draft_model=noisy_draft, tensor_parallel_size=2, cpu_cores=cpu_cores, block_size=8
    ) as llm:
        choice, resolved = llm.engine.plan.choice, llm.engine.config
        assert (
            set(choice.predicted_tok_s) <= {"ar", "sd", "ssd"}
            and choice.mode in choice.predicted_tok_s
        )
        predicted = choice.predicted_tok_s
        assert (
            choice.mode == ("sd" if predicted["sd"] >= choose.MARGIN * predicted["ar"] else "ar")
            or "ssd" in predicted
        )
        # the ranks were predicted at least as fast as one process
        if resolved.parallel.tensor_parallel_size == 2:
            assert (
                "2 tensor-parallel ranks (cores " in choice.how
                and "SSD not a candidate" in choice.how
            )
            assert set(predicted) == {"ar", "sd"} and resolved.parallel.cpu_cores == cpu_cores
        else:  # one process was predicted faster: said in the choice, run on the same cores
            assert choice.how.startswith("tensor parallelism predicted slower: 2 ranks ")
        assert resolved.speculative.mode == choice.mode and llm.engine.execution()[
            "mode"
        ] == choice.describe() + (
            PER_STEP_NOTE.format(k=llm.engine.k) if llm.engine.step_choice is not None else ""
        )
        outs = llm.generate(_prompts(3), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == greedy_oracle(target)[:3]
    stored = sorted(
        (private_cache / "calibrations").iterdir()
    )  # the ranks' costs, and one process's
    tp_costs = [MeasuredCosts.load(str(p)) for p in stored if p.name.startswith("mode-costs-tp2-")]
    assert len(stored) == 2 and len(tp_costs) == 1
    assert tp_costs[0].draft_cores == [] and tp_costs[0].target_all[9] > 0


@pytest.mark.parametrize("faster", ["ranks", "one process"])
def test_tp_runs_one_process_where_that_is_predicted_faster(
    target, noisy_draft, private_cache, monkeypatch, caplog, faster
):
    """auto with tp=2 predicts the ranks and one process on the same cores; the faster runs, and a
    fallback to one process is said in one line. A mode given explicitly keeps the ranks unasked."""
    cpu_cores, _ = _two_cores()
    ranks_s, one_s = (0.05, 0.1) if faster == "ranks" else (0.1, 0.05)

    def costs(*args, **_):
        forward_s = ranks_s if len(args[-1].ranks) == 2 else one_s
        return replace(_fake_costs([]), target_all={1: forward_s}, target_one={1: forward_s}), False

    monkeypatch.setattr(survey, "load_or_measure", costs)
    monkeypatch.setattr(
        choose,
        "predict_all",
        lambda c, acc: {
            "ar": Prediction("ar", 0, 1 / c.target_all(1)),
            "sd": Prediction("sd", 2, 0.5 / c.target_all(1)),
        },
    )
    with caplog.at_level("WARNING", logger="ssd_engine"):
        config, choice = choose.resolve_auto(_tp_config(target, noisy_draft, cpu_cores=cpu_cores))
    lines = [r.getMessage() for r in caplog.records if "tensor parallelism" in r.getMessage()]
    if faster == "ranks":
        assert (
            config.parallel.tensor_parallel_size == 2
            and config.parallel.cpu_cores == cpu_cores
            and not lines
        )
    else:
        assert (
            config.parallel.tensor_parallel_size == 1
            and config.parallel.cpu_cores == cpu_cores.replace(";", ",")
        )
        assert lines == [
            "tensor parallelism predicted slower: 2 ranks 10.00 tok/s (ar), one process 20.00 (ar); "
            "running one process (a mode given with --mode keeps the ranks)"
        ]
        assert choice.how.startswith(lines[0]) and config.speculative.mode == choice.mode == "ar"
    forced = _tp_config(target, noisy_draft, cpu_cores=cpu_cores, speculative_mode="ar")
    assert plan(forced).config.parallel.tensor_parallel_size == 2


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_fixed_prediction_is_applied_whole_under_tp(
    target, noisy_draft, private_cache, monkeypatch, mode
):
    """Mode, K, the draft's format and the ranks' cores, as predicted, with the target on two ranks."""
    cpu_cores, _ = _two_cores()
    fixed = {"ar": Prediction("ar", 0, 1.0), "sd": Prediction("sd", 2, 1.0 + (mode == "sd"))}
    monkeypatch.setattr(survey, "load_or_measure", lambda *args, **_: (_fake_costs([]), False))
    monkeypatch.setattr(choose, "predict_all", lambda costs, acc: fixed)
    with LLM(
        target, draft_model=noisy_draft, tensor_parallel_size=2, cpu_cores=cpu_cores, block_size=8
    ) as llm:
        resolved = llm.engine.config
        assert resolved.speculative.mode == mode and resolved.parallel.tensor_parallel_size == 2
        assert resolved.parallel.cpu_cores == cpu_cores and len(llm.engine.runner.processes) == 1
        if mode == "sd":
            assert llm.engine.k == 3 and llm.engine.step_choice.start == 2
            assert llm.engine.plan.draft_format.name == "int8"
        else:
            assert llm.engine.speculator is None
        outs = llm.generate(_prompts(2), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == greedy_oracle(target)[:2]


def _tp_config(target, draft, **options):
    from ssd_engine.core.config import EngineConfig

    return EngineConfig.from_kwargs(
        model=target, draft_model=draft, tensor_parallel_size=2, block_size=8, **options
    )


@pytest.mark.parametrize("fastest", ["ssd", "ar"])
def test_tp_with_a_core_set_for_the_draft_predicts_ssd_too(
    target, noisy_draft, private_cache, monkeypatch, fastest
):
    """Four cores, tp=2: AR and SD's ranks on 0,1 and 2,3, SSD's on 0,1 and 2 with its draft on 3.
    SSD is a candidate and runs when predicted fastest, with its K, budget, format and cores; AR runs
    when the predictions say SSD is slower."""
    fixed = {
        "ar": Prediction("ar", 0, 2.0),
        "sd": Prediction("sd", 2, 1.5),
        "ssd": Prediction(
            "ssd", 3, 3.0 if fastest == "ssd" else 1.0, {"budget": 5, "t_p": 0.8, "t_jit": 0.3}
        ),
    }
    seen = {}
    monkeypatch.setattr(mode_placement, "available_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(
        survey,
        "load_or_measure",
        lambda *args, **_: (
            seen.setdefault("placement", args[-1]) and (_fake_costs(args[-1].ssd_draft), False)
        ),
    )
    monkeypatch.setattr(choose, "predict_all", lambda costs, acc: fixed)
    config, choice = choose.resolve_auto(_tp_config(target, noisy_draft))
    assert seen["placement"].ranks == [[0, 1], [2, 3]] and seen["placement"].ssd_ranks == [
        [0, 1],
        [2],
    ]
    assert (
        "SSD's ranks on cores 0,1;2 and its draft on cores 3" in choice.how
        and "not a candidate" not in choice.how
    )
    assert choice.mode == config.speculative.mode == fastest
    if fastest == "ssd":
        assert (
            config.speculative.k,
            config.speculative.ssd.budget,
            config.speculative.draft_dtype,
        ) == (
            3,
            5,
            "int8",
        )
        assert config.parallel.cpu_cores == "0,1;2;3"
    else:
        assert config.parallel.cpu_cores == "0,1;2,3" and config.model.num_threads is None


def test_torchrun_ranks_do_not_place_a_draft_and_only_rank_0_measures(
    target, noisy_draft, private_cache, monkeypatch
):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(
        survey, "load_or_measure", lambda *args, **_: pytest.fail("rank 1 measured")
    )
    config, choice = choose.resolve_auto(_tp_config(target, noisy_draft))
    assert config.speculative.mode == "ar" and "torchrun rank 1" in choice.how
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(mode_placement, "available_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(
        survey, "load_or_measure", lambda *args, **_: (_fake_costs(args[-1].ssd_draft), False)
    )
    fixed = {"ar": Prediction("ar", 0, 1.0), "sd": Prediction("sd", 2, 2.0)}
    monkeypatch.setattr(choose, "predict_all", lambda costs, acc: fixed)
    config, choice = choose.resolve_auto(_tp_config(target, noisy_draft))
    assert (
        config.speculative.mode == "sd" and config.parallel.cpu_cores is None
    )  # torchrun's ranks are not placed
    assert "under torchrun the SSD draft gets no cores of its own" in choice.how


def test_cuda_is_placed_by_gpu_and_measured_where_one_gpu_holds_the_target(
    target, noisy_draft, private_cache, monkeypatch
):
    """No GPU here: the GPUs are faked. A tensor-parallel target on GPUs is not timed: auto runs SSD
    where its draft gets a GPU of its own, else SD, and says why; given measured costs (faked, as
    planning/gpu_costs.py measures them on a GPU) it predicts and chooses as on CPU, SSD a candidate
    only with a GPU of its own."""
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.planning import gpu_costs

    gpus = ["fake GPU"] * 3
    monkeypatch.setattr(mode_placement, "_gpus", lambda: gpus)
    config = EngineConfig.from_kwargs(
        model=target, draft_model=noisy_draft, device="cuda", block_size=8
    )
    for count, mode in ((3, "ssd"), (2, "sd")):
        del gpus[count:]
        chosen, choice = choose.resolve_auto(config.with_options(tensor_parallel_size=2))
        assert chosen.speculative.mode == mode and choice.how.startswith(
            "not measured: planning/gpu_costs.py"
        )
    placements = []
    monkeypatch.setattr(
        gpu_costs,
        "measure",
        lambda *args: placements.append(args[-1]) or _fake_costs(args[-1].ssd_draft),
    )
    chosen, choice = choose.resolve_auto(config)
    assert (
        placements[0].ranks == [[0]]
        and placements[0].ssd_draft == [1]
        and placements[0].device == "cuda"
    )
    assert set(choice.predicted_tok_s) == {"ar", "sd", "ssd"} and "GPU(s)" in choice.how
    assert chosen.speculative.mode == choice.mode != "auto"
    assert (
        chosen.speculative.draft_dtype == "auto" and chosen.parallel.cpu_cores is None
    )  # the int formats and cores are CPU-only
    best = max(choice.predicted_tok_s, key=choice.predicted_tok_s.get)
    assert (
        choice.mode == best
        or choice.predicted_tok_s[best] < choose.MARGIN * choice.predicted_tok_s["ar"]
    )
    _, two_ranks = choose.resolve_auto(config.with_options(tensor_parallel_size=2))
    assert "ssd" not in two_ranks.predicted_tok_s and "SSD not a candidate" in two_ranks.how
