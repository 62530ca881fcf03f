"""experiments/gpu_check.py, the device check a GPU session runs as one prepared command: its deadline, its JSON
after every phase, the allocator's retries and OOMs in every record, the issue's goals read from the phases, the
switches between today's path and issue 44's, the prompt lengths, the command its --help gives, and TRL's phase
dry-run on the CPU (where TRL is installed). tests/test_gpu_path.py runs every other phase at tiny scale."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import gpu_check  # noqa: E402


def test_help_gives_the_one_command_for_a_gpu_session():
    """The next session lent a GPU runs what --help says, as it says it: wheels, budget, JSON under $OUT."""
    out = subprocess.run([sys.executable, "experiments/gpu_check.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120).stdout
    assert 'carry [".whl"], timeout_s 480' in out and "bash experiments/gpu_wheels.sh" in out
    assert "python experiments/gpu_check.py --wheels .whl" in out and "--budget-s 400 --out $OUT/gpu_check.json" in out
    assert "--memory-cap-gib 76" in out and "THE SECOND COMMAND" in out  # an 80 GB card's usable memory, not 78
    for phase in gpu_check.DEFAULT_PHASES:
        assert f"  {phase} " in out, phase


def test_the_json_is_written_after_every_phase_and_the_deadline_skips_what_would_not_fit(tmp_path):
    path = str(tmp_path / "check.json")
    report = gpu_check.Report(path, torch.device("cpu"), budget_s=100, estimates={"a": 10, "b": 500, "c": 10})
    report.run("a", lambda: {"x": 1})
    assert [p["phase"] for p in json.load(open(path))["phases"]] == ["a"]  # on disk before the next phase
    report.run("b", lambda: pytest.fail("a phase past the deadline must not run"))
    report.run("c", lambda: 1 / 0)
    report.run("d", lambda: sys.exit(2))  # train.py's flag errors exit: the check goes on (it once died there)
    phases = json.load(open(path))["phases"]
    assert [(p["phase"], p["ok"]) for p in phases] == [("a", True), ("b", None), ("c", False), ("d", False)]
    assert "budget" in phases[1]["skipped"] and "ZeroDivisionError" in phases[2]["error"]


def test_every_record_counts_the_allocators_retries_and_out_of_memory_events(tmp_path, monkeypatch):
    """A stand-in for the card's counters (torch.cuda.memory_stats): the retries a phase caused, its OOM events,
    and a phase killed by an OOM, all reach the record and the goals' no-OOM-no-retry line."""
    stats = {"num_alloc_retries": 3, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    report = gpu_check.Report(str(tmp_path / "check.json"), torch.device("cuda"))
    report.run("calm", lambda: {})
    assert gpu_check.goals(report)["no_oom_no_retry"]["met"] is True

    def retrying():
        stats["num_alloc_retries"] += 2
        return {}

    def dying():
        stats["num_ooms"] += 1
        raise torch.OutOfMemoryError("CUDA out of memory")
    rec = report.run("retrying", retrying)
    assert (rec["alloc_retries"], rec["ooms"]) == (2, 0)
    rec = report.run("dying", dying)
    assert rec["ok"] is False and rec["out_of_memory"] is True and rec["ooms"] == 1
    line = json.load(open(tmp_path / "check.json"))["goals"]["no_oom_no_retry"]
    assert line == {"alloc_retries": 2, "ooms": 2, "met": False}


def test_the_goals_are_read_from_the_phases_measured_steps_after_the_warm_up():
    report = gpu_check.Report(os.devnull + "_unused", torch.device("cpu"))
    report.phases = [
        {"phase": "default_step", "ok": True, "steps": [{"seconds": 40.0}, {"seconds": 5.0}, {"seconds": 7.0}],
         "peak_allocated_gib": 41.0},
        {"phase": "decode", "ok": True, "after": {"rows_256": {"ms_per_decode_step": 7.5}}},
        {"phase": "trl", "ok": True, "ours_vs_trl": {"ours": 0.2, "single": 0.1}}]
    g = gpu_check.goals(report)
    assert g["step_s"] == {"measured": 6.0, "goal": 6.0, "met": True}   # the median of 5 and 7: step 1 left out
    assert g["decode_ms_256_rows"]["met"] is True and g["peak_gib_experts"]["met"] is False
    assert g["ours_vs_trl"]["met"] is True and g["peak_gib_precomputed"]["measured"] is None


def test_before_sets_todays_path_for_the_phase_and_puts_it_back():
    import rollout
    from lib import static_decode
    now = {name: getattr(module, name) for module, name, _ in gpu_check.SWITCHES if hasattr(module, name)}
    rec = {}
    with gpu_check.path("before", rec):
        assert static_decode.DECODE == "eager"
        assert getattr(rollout, "PLAIN_HEADS", ()) == ()
    assert {name: getattr(module, name) for module, name, _ in gpu_check.SWITCHES if hasattr(module, name)} == now
    assert rec["switches"]["DECODE"] == "'eager'" and rec["switches_absent"] == [
        name for module, name, _ in gpu_check.SWITCHES if not hasattr(module, name)]
    with gpu_check.path("after", {}):
        assert static_decode.DECODE == now["DECODE"]


def test_todays_train_flags_are_passed_only_where_train_knows_them():
    argv = ["--preset", "smoke"]
    assert gpu_check.known_flags(argv, [["--no-such-flag", "1"]]) == []
    assert gpu_check.known_flags(argv, [["--steps", "3"]]) == [["--steps", "3"]]


def test_real_prompt_lengths_swap_the_shape_tokenizer_for_the_stand_in_and_back():
    from lib import shape_models
    own = shape_models.tokenizer
    with gpu_check.prompt_lengths("real"):
        tok = shape_models.tokenizer(151936)
        assert len(tok("What is 17 + 25?")["input_ids"]) == 10  # 'What', ' is', ' ', '1', '7', ' +', ' ', '2', '5', '?'
        small = shape_models.tokenizer(4096)  # no room for the merges: one token per byte, as before
        assert len(small("What is")["input_ids"]) == 7
    assert shape_models.tokenizer is own
    with gpu_check.prompt_lengths("bytes"):
        assert shape_models.tokenizer is own


def test_trl_phase_runs_on_cpu_at_tiny_scale(tmp_path):
    """TRL's GRPOTrainer in experiments/bench.py's worker process, as the GPU phase runs it (gradient
    accumulation, the callback's clock), on the tiny policy; ours / TRL from the single step beside it."""
    pytest.importorskip("trl")
    out = str(tmp_path / "check.json")
    res = subprocess.run([sys.executable, "experiments/gpu_check.py", "--tiny", "--phases",
                          "default_step_single,trl", "--out", out], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    trl = {p["phase"]: p for p in json.load(open(out))["phases"]}["trl"]
    assert trl["ok"] and len(trl["step_seconds"]) == 1 and trl["gradient_checkpointing"] is True
    assert trl["ours_vs_trl"]["single"] > 0 and trl["ours_vs_trl"]["ours"] is None  # default_step did not run


def test_every_phase_leaves_a_started_marker_and_its_figures_as_they_come(tmp_path):
    """A phase killed by the call's time limit still leaves a trace: a "<phase>.started" file beside the JSON before
    it runs, and each variant's figures in the JSON as it finishes (report.progress), replaced by the whole record
    when the phase ends."""
    path = str(tmp_path / "check.json")
    report = gpu_check.Report(path, torch.device("cpu"))

    def phase():
        assert os.path.exists(tmp_path / "slow.started")
        report.progress("slow", {"before": {"rows_32": 1.0}})
        on_disk = json.load(open(path))["phases"]
        assert on_disk == [{"phase": "slow", "ok": None, "running": True, "before": {"rows_32": 1.0}}]
        return {"before": {"rows_32": 1.0}, "after": {"rows_32": 0.5}}
    report.run("slow", phase)
    phases = json.load(open(path))["phases"]
    assert len(phases) == 1 and phases[0]["ok"] is True and phases[0]["after"] == {"rows_32": 0.5}


def test_trls_worker_pipe_has_a_deadline(tmp_path):
    """A worker that never answers must not eat the rest of the call: recv(timeout) gives up with TimeoutError."""
    import time
    import bench
    w = bench.Worker.__new__(bench.Worker)
    w.name, w.rss, w.log = "hung", 0.0, open(tmp_path / "hung.log", "w")
    w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        with pytest.raises(TimeoutError, match="no reply within"):
            w.recv(timeout=1)
        assert time.time() - t0 < 10
    finally:
        w.proc.kill()


def test_the_sdpa_backend_is_read_from_the_profilers_names():
    names = ["aten::linear", "aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
             "aten::_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    assert gpu_check.sdpa_backends(names) == {"backends": ["cudnn", "efficient"], "kernels": names[2:3] + names[4:]}
    assert gpu_check.sdpa_backends(["aten::_scaled_dot_product_attention_math", "aten::bmm"])["backends"] == ["math"]


def test_the_second_command_runs_what_the_first_skipped_and_compares_a_backend_it_found(tmp_path):
    report = gpu_check.Report(str(tmp_path / "check.json"), torch.device("cpu"), budget_s=100,
                              estimates={"decode": 1, "trl": 500, "writers": 500})
    report.run("decode", lambda: {"after": {"sdpa_backend": {"backends": ["cudnn"]}}})
    report.run("trl", lambda: {})
    report.run("writers", lambda: {})
    cmds = json.load(open(tmp_path / "check.json"))["next_commands"]
    assert "--phases trl,writers" in cmds[0] and "--out $OUT/gpu_check_2.json" in cmds[0]
    assert "--phases decode --sdpa-backend efficient" in cmds[1] and len(cmds) == 2
    report.run("default_step", lambda: {"peak_allocated_gib": 44.9})  # over the goal, the merged copy kept
    assert "--phases default_step --graph-lora unmerged" in gpu_check.next_commands(report)[2]


def test_decode_records_capture_apart_from_replay_tokens_compared_and_a_forced_backend(tmp_path):
    """The decode phase at tiny scale on the CPU, SDPA forced to the math kernel (--sdpa-backend): each variant's
    first call (where the card captures) apart from its steady call, the graph's tokens compared with the eager loop's
    from the same uniforms, and the backend that ran, read by the profiler."""
    out = str(tmp_path / "check.json")
    assert gpu_check.main(["--tiny", "--phases", "decode", "--sdpa-backend", "math", "--out", out]) == 0
    rec = json.load(open(out))["phases"][0]
    assert rec["ok"] and rec["new_tokens"] == 8 and rec["sdpa_forced"] == "math"
    for name in gpu_check.DECODE_VARIANTS:
        rows = rec[name]["rows_8"]
        assert rows["first_call_decode_seconds"] > 0 and rows["ms_per_decode_step"] > 0
        assert rec[name]["sdpa_backend"]["backends"] == ["math"]
    assert rec["after"]["rows_8"]["decode_path"] == ["static", None]  # a CPU runs the static loop eagerly
    assert rec["tokens_equal"]["after_vs_eager_grouped"]["rows_8"] == 1.0
