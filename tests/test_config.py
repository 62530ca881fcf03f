"""support/harness/config.py and checks.py: a preset is a plain dict of flag values that explicit flags override,
and config.json records the resolved values; --help shows every default and the presets, each flag once in its
group, in 100 columns; a negative number is a flag's value
(accepted where the flag's type allows it, refused with the flag's own message where it does not); --config
replays a run's config.json to the same metrics, a flag beside it wins, and a bad file is one line and exit code 2
before anything is written."""
import json
import re
import os
import sys

import pytest

from support.harness.checks import parse_args
from support.harness.config import PRESETS, ArgumentParser, number

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
from record_metrics import POCKET_FLAGS  # noqa: E402  (the README's first command before presets)


def test_the_pocket_preset_is_the_readme_first_command():
    preset = vars(parse_args(["--preset", "pocket"]))
    flags = vars(parse_args(POCKET_FLAGS + ["--out", "runs/pocket-first"]))
    assert preset.pop("preset") == "pocket" and flags.pop("preset") is None
    assert preset == flags
    assert all(type(preset[k]) is type(flags[k]) for k in preset), "the same types, so config.json matches"


def test_a_flag_given_beside_a_preset_wins_even_at_its_default():
    args = parse_args(["--preset", "pocket", "--steps", "2", "--grad-accum", "8", "--out", "elsewhere"])
    assert (args.steps, args.grad_accum, args.out) == (2, 8, "elsewhere")  # 8 is the flag's own default
    assert args.team == "pocket" and args.lr == 1e-3                           # the rest from the preset


def test_every_preset_names_real_flags():
    known = set(vars(parse_args([])))
    for name, values in PRESETS.items():
        assert set(values) <= known, (name, set(values) - known)


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1e-3"], "--lr: must be > 0, got -1e-3"),
    (["--router-lr", "-5"], "--router-lr: must be > 0, got -5"),
    (["--beta", "-0.04"], "--beta: must be >= 0, got -0.04"),
    (["--warmup-steps", "-1"], "--warmup-steps: must be >= 0, got -1"),
    (["--format-bonus", "-.1"], "--format-bonus: must be >= 0, got -.1"),
    (["--lr", "-inf"], "--lr: must be > 0, got -inf"),
])
def test_a_negative_value_is_refused_with_the_flags_own_message(flags, message, capsys):
    """Before: argparse took "-1e-3" for an option and answered "expected one argument"."""
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("text, value", [("-1e-3", -1e-3), ("-5", -5.0), ("-.5", -0.5), ("-2.5E+3", -2500.0)])
def test_a_negative_number_is_a_value_where_the_flag_allows_it(text, value):
    p = ArgumentParser()
    p.add_argument("--shift", type=number(float, float("-inf")), default=0.0)
    p.add_argument("--flag", action="store_true")
    assert p.parse_args(["--shift", text, "--flag"]).shift == value


def test_help_shows_every_default_and_the_presets(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "(default: 0.0001)" in out and "(default: 0.04)" in out and "(default: ours)" in out
    assert "pocket: --task chain_sum" in out and "--out runs/pocket-first" in out and "smoke:" in out


def help_sections(parse_args_of_script, capsys):
    """A script's --help as [(group title, [its flags' option strings])], in the order printed, and its lines."""
    with pytest.raises(SystemExit) as e:
        parse_args_of_script(["--help"])
    assert e.value.code == 0
    lines, sections = capsys.readouterr().out.splitlines(), []
    for line in lines:
        if re.fullmatch(r"\S[^()]*:", line):  # a group's title ("the run:"; not the presets' line, nor usage)
            sections.append((line[:-1], []))
        elif m := re.match(r"  (-[-\w]+(, -[-\w]+)*)", line):  # a flag's first line: "  --lr LR   help..."
            sections[-1][1].extend(m.group(1).split(", "))
    return sections, lines


@pytest.mark.parametrize("script", ["train", "conductor", "rlae"])
def test_help_groups_the_papers_settings_then_the_levers_then_the_run_each_flag_once_in_100_columns(
        script, capsys, monkeypatch):
    """Before: one list of every flag in the order they were added, 34 of its 170 lines over 120 characters
    (the help text was printed unwrapped) and the usage line over 100 whatever the terminal. A neighbour's own
    flags come last, in a group of its own."""
    from neighbours import conductor, rlae

    from support.harness import checks, config
    monkeypatch.setenv("COLUMNS", "300")  # the width is fixed, whatever the terminal's
    module = {"train": checks, "conductor": conductor, "rlae": rlae}[script]
    parsers, parse = [], checks.parse  # the script's parser, as its parse_args hands it to parse
    monkeypatch.setattr(module, "parse", lambda p, argv: parsers.append(p) or parse(p, argv))
    sections, lines = help_sections(module.parse_args, capsys)
    own = {"train": [], "conductor": ["the conductor's own"], "rlae": ["RLAE's own"]}[script]
    assert [title for title, _ in sections] == ["options", "the paper's settings", "levers", "the run"] + own
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    printed = [flag for _, flags in sections for flag in flags]
    defined = [flag for action in parsers[-1]._actions for flag in action.option_strings]
    assert sorted(printed) == sorted(defined) and len(set(printed)) == len(printed)  # each flag once
    group = {flag: title for title, flags in sections for flag in flags}
    assert {group[f] for f in ("--task", "--team", "--method", "--group-size", "--beta", "--lora-rank",
                               "--latent-dim")} == {"the paper's settings"}
    assert {group[f] for f in ("--channel-weight", "--state-norm", "--dynamic-sampling", "--context-split",
                               "--rollout-dtype", "--attention")} == {"levers"}
    assert {group[f] for f in ("--out", "--resume", "--save-every", "--track", "--device", "--dtype", "--plan",
                               "--precompute-states", "--deterministic", "--preset")} == {"the run"}
    train_flags = {f for a in config.build_parser()._actions for f in a.option_strings}
    assert {f for f in printed if f not in train_flags} == {f for title, flags in sections if title in own
                                                           for f in flags}


def test_help_fits_100_columns_whatever_the_methods_names_are(capsys, monkeypatch):
    """Before: --method's choices were printed inline ("--method {bare_anchor,...,soft_prompt}", 95 columns), so a
    fork's ninth method with a name of five or more characters pushed that line past 100. Its choices now sit in
    the help text, which argparse wraps."""
    import baselines
    monkeypatch.setitem(baselines.METHODS, "a_forks_method_with_a_long_name", baselines.METHODS["ours"])
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "a_forks_method_with_a_long_name" in out and "soft_prompt" in out
    assert all(len(line) <= 100 for line in out.splitlines()), max(out.splitlines(), key=len)
    with pytest.raises(SystemExit):  # still a choice: an unknown name is refused, naming the flag
        parse_args(["--method", "nope"])
    assert capsys.readouterr().err.startswith("error: --method: invalid choice: 'nope'")


def test_config_json_records_the_preset_and_the_resolved_values(tmp_path):
    """The smoke preset end to end: config.json, the before/after line's scores, and the run's plot."""
    from train import main
    out = str(tmp_path / "smoke")
    main(["--preset", "smoke", "--device", "cpu", "--eval-items", "2", "--out", out])
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["preset"] == "smoke" and cfg["team"] == "tiny" and cfg["steps"] == 3 and cfg["eval_items"] == 2
    validation = json.load(open(os.path.join(out, "validation.json")))
    assert len(validation["before"]) == len(validation["after"]) == 2
    pytest.importorskip("matplotlib")
    assert os.path.getsize(os.path.join(out, "plot.png")) > 1000


@pytest.mark.parametrize("method", ["conductor", "rlae"])
def test_a_neighbour_asked_of_train_py_says_where_it_lives(method, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--method", method])
    assert e.value.code == 2 and f"python neighbours/{method}.py" in capsys.readouterr().err


def test_resume_reads_a_flag_newer_than_the_run_as_its_default(tmp_path):
    """A run saved before a flag existed ran as that flag's default does: resuming it with the default is
    the same run; with another value it is not, and the message names the flag."""
    from support.harness.checkpoint import check_resume
    from support.harness.config import build_parser
    args = parse_args(["--out", str(tmp_path)])
    saved = {k: v for k, v in vars(args).items() if k != "format_bonus_strict"}  # as if saved before the flag
    with open(tmp_path / "config.json", "w") as f:
        json.dump(saved, f)
    assert check_resume(args, str(tmp_path / "config.json"), build_parser().get_default) is None
    args.format_bonus_strict = True
    msg = check_resume(args, str(tmp_path / "config.json"), build_parser().get_default)
    assert msg.startswith("--resume: --format-bonus-strict True differs from the run's False")
    assert check_resume(args, str(tmp_path / "config.json")).startswith("--resume: --format-bonus-strict")


def test_help_states_each_default_once(capsys):
    """A flag whose help already says its default (`default 500; 233 for gsm8k`) gets no second `(default: None)`
    appended, and an unset or off flag no `(default: None)` / `(default: False)` noise."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    flags = re.split(r"\n  (?=-)", out.split("options:", 1)[1])          # one chunk per flag
    twice = [f.split()[0] for f in flags if len(re.findall(r"\(default[: ]", f)) > 1]
    assert twice == [], f"two defaults in --help for {twice}"
    assert "(default: None)" not in out and "(default: False)" not in out


@pytest.mark.parametrize("script", ["evaluate.py", "neighbours/rlae.py evaluate"])
def test_evaluates_help_shows_its_defaults_once(script, capsys):
    """evaluate.py --help (and a neighbour's evaluate) says what an unset flag does, as train.py's does (before:
    no default shown); a help that already names its default, or an unset flag, gets none appended."""
    from evaluate import main as evaluate_main
    from neighbours.plumbing import evaluation
    with pytest.raises(SystemExit) as e:
        if script == "evaluate.py":
            evaluate_main(["--help"])
        else:
            with evaluation(["--help"], "neighbours/rlae.py"):
                pass
    out = capsys.readouterr().out
    assert e.value.code == 0 and "(default: 4000)" in out and "(default: 50)" in out and "(default: auto)" in out
    flags = re.split(r"\n  (?=-)", out.split("options:", 1)[1])
    assert [f.split()[0] for f in flags if len(re.findall(r"\(default[: ]", f)) > 1] == []
    assert "(default: None)" not in out and "(default: False)" not in out


def test_the_run_plot_shows_both_curves_the_validation_and_the_uniform_references(tmp_path, monkeypatch):
    """plot.png: reward and solve rate both visible (different styles: they coincide under exact rewards), the
    validation before/after as points, utilisation beside 1/n and the entropy beside log n on its own panel."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from support.harness import plot
    rows = [{"step": s, "reward": 0.5, "solve_rate": 0.5, "answer_rate": 1.0, "kl": 0.0, "entropy": 1.09,
             "utilization": [0.3, 0.3, 0.4], "utilization_names": ["a", "b", "c"]} for s in (1, 2)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(tmp_path / "validation.json", "w") as f:
        json.dump({"items": 2, "before": [0.0, 0.0], "after": [1.0, 0.0]}, f)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot.plot_run(str(tmp_path))
    labels = [[t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []
              for ax in figures[0].axes]
    assert labels[0] == ["reward", "solve rate", "validation before: 0.0 %", "validation after: 50.0 %"]
    assert "1/n = 0.333 (uniform)" in labels[3] and labels[4] == ["entropy H", "log n = 1.099 (uniform)"]


# ---- --config RUN/config.json: replay a run ------------------------------------------------------------------

SMOKE = ["--preset", "smoke", "--eval-items", "0", "--steps", "2", "--device", "cpu"]
WALL_CLOCK = ("seconds", "tokens_per_s")  # differ between two runs of the same numbers


def letter_reward(items, completions):
    """1 if the completion starts with a lowercase ASCII letter: reward variance, so the numbers move."""
    return [1.0 if c[:1].isascii() and c[:1].islower() else 0.0 for c in completions], {"ok": len(completions)}


def numbers(out):
    """metrics.jsonl without its wall-clock fields."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK} for line in f]


def test_config_replays_a_run_to_the_same_metrics(tmp_path):
    """Two steps of the smoke preset, then the same run from its config.json alone into another folder: the same
    numbers, bit for bit; with --steps 1 beside --config, the first step of it."""
    from train import main
    first, replay, shorter = (str(tmp_path / name) for name in ("first", "replay", "shorter"))
    main(SMOKE + ["--lr", "1e-2", "--out", first], score_batch=letter_reward)
    config = os.path.join(first, "config.json")
    main(["--config", config, "--out", replay], score_batch=letter_reward)
    assert numbers(replay) == numbers(first) and len(numbers(first)) == 2
    assert numbers(first)[1]["grad_norm"] > 0  # the run moved: the comparison has teeth
    saved, again = (json.load(open(os.path.join(out, "config.json"))) for out in (first, replay))
    assert {k: v for k, v in again.items() if k not in ("out", "config")} == \
        {k: v for k, v in saved.items() if k not in ("out", "config")}
    assert again["config"] == config
    main(["--config", config, "--steps", "1", "--out", shorter], score_batch=letter_reward)
    assert numbers(shorter) == numbers(first)[:1]


def saved_config(tmp_path, flags=SMOKE, **changes):
    """A config.json as train.py writes it (the resolved flags and what resume_run records beside them), with
    `changes`; returns its path."""
    args = parse_args(flags + ["--out", str(tmp_path / "first")])
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump({**vars(args), "team_models": {"policy": "tiny:llama"}, "device_used": "cpu", "processes": 1,
                   **changes}, f)
    return path


def test_config_gives_back_the_same_flags(tmp_path):
    """Every value and its type, the preset's and the explicit ones alike; only --out and --config differ."""
    flags = SMOKE + ["--worked-example", "--task-config", '{"max_terms": 2}', "--tis-cap", "2", "--rollout-dtype",
                     "bfloat16", "--expert-depth", "0.5"]
    want = vars(parse_args(flags + ["--out", str(tmp_path / "first")]))
    got = vars(parse_args(["--config", saved_config(tmp_path, flags), "--out", str(tmp_path / "replay")]))
    assert got.pop("out") == str(tmp_path / "replay") and got.pop("config") == str(tmp_path / "config.json")
    assert want.pop("out") == str(tmp_path / "first") and want.pop("config") is None
    assert got == want and all(type(got[k]) is type(want[k]) for k in want)


def test_a_flag_given_beside_config_wins_even_at_its_default(tmp_path):
    path = saved_config(tmp_path, lr=1e-3, grad_accum=2, worked_example=True)
    args = parse_args(["--config", path, "--lr", "0.5", "--grad-accum", "8", "--out", "elsewhere"])
    assert (args.lr, args.grad_accum, args.out) == (0.5, 8, "elsewhere")  # 8 is the flag's own default
    assert args.worked_example and args.team == "tiny" and args.steps == 2  # the rest from the file


def test_config_replays_a_text_that_looks_like_flags_as_that_text(tmp_path):
    """The parser reads a replayed text as `--flag=TEXT`: one that begins with a dash is the flag's value."""
    args = parse_args(["--config", saved_config(tmp_path, response_prefix="--lr 5", lr=1e-3), "--out", "elsewhere"])
    assert (args.response_prefix, args.lr) == ("--lr 5", 1e-3)


def test_config_replays_neither_out_nor_resume(tmp_path):
    args = parse_args(["--config", saved_config(tmp_path, resume=True), "--out", str(tmp_path / "replay")])
    assert args.out == str(tmp_path / "replay") and not args.resume


@pytest.mark.parametrize("case, message", [
    ("missing", "--config {path}: cannot read it (FileNotFoundError: No such file or directory)"),
    ("folder", "--config {path}: not a file (a run's config.json)"),  # a folder or a pipe: refused unread
    ("not JSON", "--config {path}: not JSON of flag values (Expecting value: line 1 column 1 (char 0))"),
    ("a list", "--config {path}: not a JSON object of flag values"),
    ("unknown keys", "--config {path}: learning_rate, max_workflow_steps: not a flag of this script"),
    ("bad number", "--config {path}: --lr: must be > 0, got -0.001"),
    ("bad choice", "--config {path}: {team_nope}"),  # the line `--team nope` gets on the command line
    ("bad switch", '--config {path}: --worked-example: "yes" is not a value of this flag'),
    ("null", "--config {path}: --lr: null is not a value of this flag"),
    ("no --out", "--config {path}: give --out, a new folder for the replay (the run's own holds that run)"),
    ("--preset", "--config {path} holds every flag's value already: drop --preset smoke and give the flags to "
                 "change beside --config"),
])
def test_a_bad_config_is_one_line_and_exit_code_2_before_anything_is_written(case, message, tmp_path, capsys,
                                                                              monkeypatch):
    import train
    monkeypatch.setattr(train, "build_run", lambda *a: pytest.fail("a model loaded"))
    path = {"missing": str(tmp_path / "nowhere.json"), "folder": str(tmp_path)}.get(case)
    changes = {"unknown keys": {"learning_rate": 1e-3, "max_workflow_steps": 2}, "bad number": {"lr": -1e-3},
               "bad choice": {"team": "nope"}, "bad switch": {"worked_example": "yes"}, "null": {"lr": None}}
    path = path or saved_config(tmp_path, **changes.get(case, {}))
    if case in ("not JSON", "a list"):
        with open(path, "w") as f:
            f.write("" if case == "not JSON" else "[1, 2]")
    out = str(tmp_path / "replay")
    flags = {"no --out": [], "--preset": ["--preset", "smoke", "--out", out]}.get(case, ["--out", out])
    with pytest.raises(SystemExit) as e:
        train.main(["--config", path] + flags)
    err = capsys.readouterr().err
    team_nope = command_line_error(["--team", "nope"], capsys) if case == "bad choice" else None
    assert e.value.code == 2 and err == f"error: {message.format(path=path, team_nope=team_nope)}\n"
    assert not os.path.exists(out)


def command_line_error(flags, capsys):
    """The line (without `error: `) that train.py's flags `flags` fail with on the command line, exit code 2."""
    with pytest.raises(SystemExit) as e:
        parse_args(SMOKE + flags + ["--out", "nowhere"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):-1]


@pytest.mark.parametrize("flag, value", [("team", "nope"), ("rollout_dtype", "int4"), ("lr", -1e-3),
                                         ("grad_accum", 2.5), ("seed", 2 ** 40)])
def test_a_replayed_value_is_read_by_the_parser_and_fails_with_the_command_lines_line(flag, value, tmp_path,
                                                                                      capsys):
    """--config reads each value with train.py's own parser, from the text the command line would give it: a bad
    value fails with the very line that text gets there, after `--config PATH: `. Before, --config checked each
    value again by hand, and a bad choice said `--team: "nope" is not a value of this flag` where the command
    line lists the choices."""
    path = saved_config(tmp_path, **{flag: value})
    want = command_line_error([f"--{flag.replace('_', '-')}={value}"], capsys)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", path, "--out", str(tmp_path / "replay")])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: --config {path}: {want}\n"
