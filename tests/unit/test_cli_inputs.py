"""``sms`` and ``simulate`` read the split's inputs one way, and an error names the input that is wrong.

One validation serves both commands, so ``--total-sms 1000000000000`` or an empty
``VLLM_DBO_COMM_SMS`` means the same in each, and the policy's errors blame the input that is
wrong (a typed ``--max-sms-used`` or ``--total-sms``), not ``VLLM_DBO_COMM_SMS=20`` when nobody
set the variable.
"""

from __future__ import annotations

import json

import pytest

from dbo_runtime.cli.main import main

FAST = ["--backend", "cpu", "--steps", "1", "--requests", "4", "--no-contrast"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DBO_COMM_SMS", "DBO_RUNTIME_DISABLE", "DBO_RUNTIME_STRICT", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def error_line(capsys: pytest.CaptureFixture[str], command: list[str]) -> str:
    """Run a command that must fail with exit 2; return its one error line without the command prefix."""
    rc = main(command)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    [line] = err.strip().splitlines()
    prefix = f"dbo-runtime {command[0]}: error: "
    assert line.startswith(prefix) and "Traceback" not in err
    return line[len(prefix) :]


# -- the error names the input that is actually wrong ---------------------------------------------


def test_odd_max_sms_used_blames_max_sms_used_not_the_comm_share(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(capsys, ["sms", "--total-sms", "132", "--max-sms-used", "5"])
    assert line.startswith("--max-sms-used=5 is not allowed; allowed values: 'none', even integers, or integers >= 20")
    assert "VLLM_DBO_COMM_SMS=20" not in line
    line = error_line(capsys, ["sms", "--total-sms", "132", "--max-sms-used", "7", "--comm-sms", "20"])
    assert line.startswith("--max-sms-used=7 is not allowed") and "--comm-sms=" not in line
    # the values the message allows really are allowed
    for ok in ("none", "6", "20", "21", "64"):
        assert main(["sms", "--total-sms", "132", "--max-sms-used", ok, "--comm-sms", "20"]) == 0
    capsys.readouterr()


def test_a_small_typed_total_blames_total_sms_when_nobody_set_the_comm_share(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(capsys, ["sms", "--total-sms", "20"])
    assert line.startswith("--total-sms=20 is not allowed; allowed values: integers in [21, 1024]")
    assert "VLLM_DBO_COMM_SMS=20" not in line
    line = error_line(capsys, ["simulate", *FAST, "--total-sms", "1"])
    assert line.startswith("--total-sms=1 is not allowed; allowed values: integers in [22, 1024]")  # the simulated device is SM90: DeepGEMM needs 2+
    assert main(["sms", "--total-sms", "21"]) == 0
    capsys.readouterr()


def test_a_typed_comm_share_is_blamed_when_it_does_not_fit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    line = error_line(capsys, ["sms", "--total-sms", "20", "--comm-sms", "20"])
    assert line.startswith("--comm-sms=20 is not allowed; allowed values: integers in [0, 19]")
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "140")
    assert error_line(capsys, ["simulate", *FAST]).startswith("VLLM_DBO_COMM_SMS=140 is not allowed; allowed values: integers in [0, 130]")  # SM90: DeepGEMM keeps 2+


# -- one validation for both commands ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--comm-sms", "x"], None, "--comm-sms='x' is not allowed; allowed values: integers >= 0"),
        (["--comm-sms", "-2"], None, "--comm-sms=-2 is not allowed; allowed values: integers >= 0"),
        ([], "", "VLLM_DBO_COMM_SMS='' is not allowed; allowed values: integers >= 0, or not set"),
        ([], "many", "VLLM_DBO_COMM_SMS='many' is not allowed; allowed values: integers >= 0, or not set"),
        ([], "19", "VLLM_DBO_COMM_SMS=19 is not allowed; allowed values: even integers up to the DeepEP manager's 20-SM"),
    ],
)
def test_sms_and_simulate_reject_the_same_values_in_the_same_words(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], env: str | None, expected: str
) -> None:
    if env is not None:
        monkeypatch.setenv("VLLM_DBO_COMM_SMS", env)
    base = ["--total-sms", "132"]
    sms = error_line(capsys, ["sms", *base, *args])
    simulate = error_line(capsys, ["simulate", *FAST, *base, *args])
    assert sms.startswith(expected), sms
    assert simulate.split(" [")[0] == sms.split(" [")[0]  # each names its own device in brackets


@pytest.mark.parametrize("env", ["abc", "19", "200"])
def test_verify_and_tune_word_a_bad_comm_share_as_sms_does(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    """One allowed-values text for VLLM_DBO_COMM_SMS: verify and tune check it with the rules sms uses."""
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", env)
    sms = error_line(capsys, ["sms", "--total-sms", "132"])
    engine = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_high_throughput"]
    for command in ("verify", "tune"):
        line = error_line(capsys, [command, *engine])
        assert line.split("; allowed values: ")[0] == sms.split("; allowed values: ")[0], (command, line, sms)
        head = sms.split(" on device profile")[0].split(" [")[0]  # sms names its device, the engine commands theirs
        assert line.startswith(head), (command, line, sms)


def test_sms_and_simulate_say_why_their_smallest_total_differs(capsys: pytest.CaptureFixture[str]) -> None:
    """sms takes a --total-sms device other than 132 as an unknown architecture (vLLM's one compute SM); simulate's
    device is SM90, where DeepGEMM's share must be even (two): each bound comes with its reason."""
    sms = error_line(capsys, ["sms", "--total-sms", "10"])
    assert "integers in [21, 1024], above the comm share 20" in sms
    assert "by at least 1 compute SM: the device's architecture is unknown, so DeepGEMM's share needs no multiple" in sms
    simulate = error_line(capsys, ["simulate", *FAST, "--total-sms", "10"])
    assert "integers in [22, 1024], above the comm share 20" in simulate
    assert "by at least 2 compute SMs: the simulated device is SM90, where DeepGEMM's share must be a multiple of 2" in simulate
    no_deep_gemm = error_line(capsys, ["sms", "--total-sms", "10", "--no-deep-gemm"])
    assert "by at least 1 compute SM: vLLM asserts the comm share is below the total" in no_deep_gemm
    assert main(["simulate", *FAST, "--total-sms", "22"]) == 0  # the bound named is itself accepted
    capsys.readouterr()


@pytest.mark.parametrize("where", ["flag", "env"])
def test_a_huge_comm_share_gets_the_range_a_too_large_one_gets(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Beyond any device the refusal still names the device's range, as 131 on the H200 does."""
    huge = "99999999999999999999"
    args = ["--comm-sms", huge] if where == "flag" else []
    if where == "env":
        monkeypatch.setenv("VLLM_DBO_COMM_SMS", huge)
    line = error_line(capsys, ["sms", "--total-sms", "132", *args])
    assert "allowed values: integers in [0, 130] on device profile, which has 132 SMs" in line, line


@pytest.mark.parametrize(("value", "shown"), [("0", "0"), ("1", "1"), ("abc", "'abc'"), ("", "''"), ("1000000000000", "1000000000000")])
def test_a_refused_total_names_the_range_that_applies(capsys: pytest.CaptureFixture[str], value: str, shown: str) -> None:
    """0 and 1 get the same bound: above the default comm share, not [1, 1024] for one and [21, 1024] for the other."""
    sms = error_line(capsys, ["sms", "--total-sms", value])
    assert sms.startswith(f"--total-sms={shown} is not allowed; allowed values: integers in [21, 1024], above the comm share 20"), sms
    simulate = error_line(capsys, ["simulate", *FAST, "--total-sms", value])
    assert simulate.startswith(f"--total-sms={shown} is not allowed; allowed values: integers in [22, 1024]"), simulate  # SM90: 2+ compute


@pytest.mark.parametrize(
    ("flag", "value", "shown", "allowed"),
    [
        ("--steps", "abc", "'abc'", "integers in [1, 1000]"),
        ("--steps", "1000000", "1000000", "integers in [1, 1000]"),
        ("--requests", "abc", "'abc'", "integers in [2, 1024]"),
        ("--seed", "-1", "-1", "integers in [0, "),
    ],
)
def test_simulate_integer_flags_are_bounded_and_worded_alike(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, shown: str, allowed: str
) -> None:
    line = error_line(capsys, ["simulate", "--backend", "cpu", flag, value])
    assert line.startswith(f"{flag}={shown} is not allowed; allowed values: {allowed}"), line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        ([], "dbo-runtime: error: a COMMAND is required: one of sms, doctor, simulate, tune, verify (see dbo-runtime --help)"),
        (["sms", "--bogus"], "dbo-runtime sms: error: unrecognized arguments: --bogus (see dbo-runtime sms --help)"),
        (["--bogus"], "dbo-runtime: error: unrecognized arguments: --bogus (see dbo-runtime --help)"),
        (["--total-sms=3"], "dbo-runtime: error: argument --total-sms belongs to a subcommand (sms, simulate): give one first (dbo-runtime sms --total-sms=3)"),
        # the value typed apart: argparse alone would take it for COMMAND ("COMMAND=3 is not allowed")
        (["--total-sms", "3"], "dbo-runtime: error: argument --total-sms belongs to a subcommand (sms, simulate): give one first (dbo-runtime sms --total-sms 3)"),
        (["--platform", "rocm"], "dbo-runtime: error: argument --platform belongs to a subcommand (sms): give one first (dbo-runtime sms --platform rocm)"),
        (["--comm-sms", "4", "sms"], "dbo-runtime: error: argument --comm-sms belongs to 'sms': give it after the subcommand (dbo-runtime sms --comm-sms 4)"),
        (["--reps", "3", "sms"], "dbo-runtime: error: argument --reps is not an option of 'sms': it belongs to tune"),
        # an engine argument verify / tune hand to vLLM: its value would be taken for COMMAND
        (["--model", "m", "verify"], "dbo-runtime: error: argument --model is no dbo-runtime option: verify takes vLLM's engine arguments after the subcommand (dbo-runtime verify --model m)"),
        (  # moved after the subcommand it would be refused there, so that is said now
            ["--rep", "3", "tune"],
            "dbo-runtime: error: --rep is not a tune option (did you mean --reps?); allowed values: tune's own options spelt in full, "
            "then vLLM's engine arguments (vLLM would read an abbreviation as one of its own options; see dbo-runtime tune --help)",
        ),
        (  # after --, nothing is an option to move
            ["--", "verify"],
            "dbo-runtime: error: COMMAND='--' is not allowed; allowed values: 'sms', 'doctor', 'simulate', 'tune', 'verify' (see dbo-runtime --help)",
        ),
        (["--bogus", "--json"], "dbo-runtime: error: argument --json belongs to a subcommand (sms, doctor, simulate, tune, verify): give one first (dbo-runtime sms --json); also unrecognized: --bogus"),
        (["--json", "sms"], "dbo-runtime: error: argument --json belongs to 'sms': give it after the subcommand (dbo-runtime sms --json)"),
        (["--bogus", "sms"], "dbo-runtime sms: error: unrecognized arguments: --bogus (see dbo-runtime sms --help)"),
        (
            ["bogus"],
            "dbo-runtime: error: COMMAND='bogus' is not allowed; allowed values: 'sms', 'doctor', 'simulate', 'tune', 'verify' "
            "(see dbo-runtime --help)",
        ),
        (
            ["simulat"],
            "dbo-runtime: error: COMMAND='simulat' is not allowed; allowed values: 'sms', 'doctor', 'simulate', 'tune', 'verify' "
            "(did you mean 'simulate'?) (see dbo-runtime --help)",
        ),
        (["doctor", "--jsn"], "dbo-runtime doctor: error: unrecognized arguments: --jsn (--jsn: did you mean --json?) (see dbo-runtime doctor --help)"),
        (["doctor", "--version"], "dbo-runtime doctor: error: unrecognized arguments: --version (see dbo-runtime doctor --help)"),  # not --json
        (
            ["simulate", "--backend", "gpu"],
            "dbo-runtime simulate: error: --backend='gpu' is not allowed; allowed values: 'auto', 'cpu', 'deep_gemm' "
            "(see dbo-runtime simulate --help)",
        ),
        (
            ["simulate", "--mode", "1"],
            "dbo-runtime simulate: error: --mode=1 is not allowed; allowed values: 'eager', 'mrv1', 'mrv2' "
            "(see dbo-runtime simulate --help)",
        ),
    ],
)
def test_usage_errors_are_one_line_naming_the_command(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bare dbo-runtime is one error line, not the whole help, and `sms --bogus` blames `sms`, not the
    top-level command."""
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (["sms", "--total-sms", "0"], "--total-sms=0"),  # refused while parsing: the text "0"
        (["sms", "--total-sms", "10"], "--total-sms=10"),  # refused by the split: the number 10
        (["sms", "--total-sms", "132", "--comm-sms", "-1"], "--comm-sms=-1"),
        (["sms", "--total-sms", "132", "--comm-sms", "131"], "--comm-sms=131"),
        (["sms", "--total-sms", "132", "--comm-sms", " 1x"], "--comm-sms=' 1x'"),
        (["sms", "--total-sms", ""], "--total-sms=''"),
        (["simulate", "--backend", "cpu", "--no-contrast", "--steps", "0"], "--steps=0"),
        (["simulate", "--backend", "cpu", "--no-contrast", "--steps", "1", "--requests", "3.5"], "--requests=3.5"),
        (["tune", "--reps", "0", "--model", "m", "-dp", "2", "-ep"], "--reps=0"),
        (["tune", "--reps", "3", "--model", "m", "-dp", "2", "-ep", "--all2all-backend", "deepep_high_throughput"], "--reps=3"),  # after parsing
        (["verify", "--timeout", "x", "--model", "m", "-dp", "2"], "--timeout='x'"),
    ],
)
def test_a_refused_value_is_quoted_one_way_wherever_it_is_refused(
    capsys: pytest.CaptureFixture[str], command: list[str], shown: str
) -> None:
    """A number shows bare whether the parser or a later check refused it; text keeps Python's quotes, so an empty
    value or a stray space stays visible."""
    line = error_line(capsys, command)
    assert line.startswith(f"{shown} is not allowed; allowed values: "), line


def test_without_deepgemm_the_bound_has_no_even_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """With --no-deep-gemm the bound names neither DeepGEMM's even count nor the SM90 bound."""
    line = error_line(capsys, ["sms", "--total-sms", "132", "--comm-sms", "132", "--no-deep-gemm"])
    assert line.startswith("--comm-sms=132 is not allowed; allowed values: integers in [0, 131]") and "DeepGEMM" not in line
    assert main(["sms", "--total-sms", "132", "--comm-sms", "131", "--no-deep-gemm"]) == 0
    capsys.readouterr()


def test_sms_and_simulate_warn_about_the_same_split_in_the_same_words(capsys: pytest.CaptureFixture[str]) -> None:
    """21 comm SMs on the SM90 profile: DeepEP HT's clamp leaves one comm SM idle and DeepGEMM's even rounding one
    compute SM; both commands say both, from one function."""
    assert main(["sms", "--total-sms", "132", "--comm-sms", "21"]) == 0
    out = capsys.readouterr().out
    sms = sorted(line.split(": ", 2)[2] for line in out.splitlines() if line.startswith("warning: device profile: "))
    assert len(sms) == 2 and any("clamps set_num_sms(21) to 20" in w for w in sms) and any("1 SM idle" in w for w in sms)
    main(["simulate", *FAST, "--comm-sms", "21"])
    err = capsys.readouterr().err
    prefix = "dbo-runtime simulate: warning: "
    assert sorted(line[len(prefix) :] for line in err.splitlines() if line.startswith(prefix)) == sms
    assert main(["sms", "--total-sms", "132", "--comm-sms", "3", "--no-expert-parallel"]) == 0
    assert "warning: device profile: 1 SM idle" in capsys.readouterr().out  # 129 compute SMs rounded down to 128


# -- a single-value option given twice ---------------------------------------------------------------


def _single_value_options() -> list[tuple[str, str, tuple[str, str]]]:
    """(command, option, two values it takes) for every single-value option of every subcommand."""
    import argparse

    from dbo_runtime.cli.main import SUBPARSERS, build_parser

    build_parser()
    found = []
    for command, sub in sorted(SUBPARSERS.items()):
        for action in sub._actions:
            if type(action).__name__ != "StoreOnce" or not action.option_strings:
                continue
            assert isinstance(action, argparse.Action)
            values = tuple(action.choices)[:1] + tuple(action.choices)[-1:] if action.choices else ("1", "2")
            found.append((command, action.option_strings[-1], (str(values[0]), str(values[-1]))))
    return found


SINGLE_VALUE_OPTIONS = _single_value_options()


def test_every_value_option_of_every_command_is_given_once() -> None:
    """Every option that takes one value goes through the refusing store (an option added later included)."""
    from dbo_runtime.cli.main import SUBPARSERS

    commands = {command for command, _, _ in SINGLE_VALUE_OPTIONS}
    assert {"sms", "simulate", "tune", "verify"} <= commands <= set(SUBPARSERS)
    assert ("simulate", "--preset", ("small", "glm53")) in SINGLE_VALUE_OPTIONS
    for sub in SUBPARSERS.values():
        assert all(type(a).__name__ != "_StoreAction" for a in sub._actions)


@pytest.mark.parametrize(("command", "option", "values"), SINGLE_VALUE_OPTIONS, ids=lambda v: v if isinstance(v, str) else None)
def test_a_single_value_option_given_twice_is_refused(
    command: str, option: str, values: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse keeps the last value without a word: ``--preset glm53 --preset small`` would run small while the
    command line also says glm53. One line naming the option and both values, before anything runs; in either
    spelling (``--flag value``, ``--flag=value``)."""
    first, second = values
    from dbo_runtime.core.errors import shown

    said = f"argument {option}: given twice ({shown(first)}, then {shown(second)}); give it once (see dbo-runtime {command} --help)"
    assert error_line(capsys, [command, option, first, f"{option}={second}"]) == said
    assert error_line(capsys, [command, f"{option}={first}", option, second]) == said


def test_the_refusal_is_a_json_document_under_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["simulate", "--json", "--preset", "glm53", "--preset", "small"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (
        "dbo-runtime simulate: error: argument --preset: given twice ('glm53', then 'small'); give it once (see dbo-runtime simulate --help)"
    )
    doc = json.loads(out)
    assert doc["schema"] == "dbo-runtime/simulate/v1" and doc["exit_code"] == 2
    assert doc["error"]["message"] == "argument --preset: given twice ('glm53', then 'small'); give it once"


def test_a_switch_given_twice_asks_for_the_same_thing_and_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Only options that take a value are refused: ``--no-contrast --no-contrast`` cannot mean two things."""
    assert main(["simulate", *FAST, "--no-contrast", "--json", "--json"]) == 0
    assert '"verdict": "PASS"' in capsys.readouterr().out


def test_the_base_parser_refuses_per_setting_in_every_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    """``OnceArgumentParser`` (the base of every parser): two spellings of one setting are one option, an
    abbreviation (where a parser takes them) too; ``append`` and ``count`` are meant to repeat; ``given_options``
    names what the last parse read from the command line."""
    from dbo_runtime.cli._common import OnceArgumentParser

    parser = OnceArgumentParser(prog="p", allow_abbrev=True)
    parser.add_argument("-o", "--out")
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--tag", action="append")
    parser.add_argument("-v", action="count")
    args = parser.parse_args(["--tag", "a", "--tag", "b", "-v", "-v", "--lev", "4"])
    assert (args.tag, args.v, args.level, args.out) == (["a", "b"], 2, 4, None)
    assert parser.given_options == {"level": ("--level", 4)}
    assert parser.parse_args([]).level == 3 and parser.given_options == {}
    for argv, said in (
        (["-o", "a", "--out", "b"], "argument -o/--out: given twice (-o 'a', then --out 'b'); give it once"),
        (["--lev", "4", "--level=5"], "argument --level: given twice (4, then 5); give it once"),
        (["--level", "4", "--le", "4"], "argument --level: given twice (4, then 4); give it once"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"p: error: {said}"


def test_a_misspelt_command_under_json_is_still_a_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    """``dbo-runtime simulat --json``: no command, so no schema to name, but a script parsing stdout still gets
    an error document rather than nothing."""
    assert main(["simulat", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] is None and doc["exit_code"] == 2
    assert (doc["error"]["parameter"], doc["error"]["value"]) == ("COMMAND", "simulat")


@pytest.mark.parametrize(
    ("argv", "schema", "message"),
    [
        (["--json"], None, "argument --json belongs to a subcommand (sms, doctor, simulate, tune, verify): give one first (dbo-runtime sms --json)"),
        (["--bogus", "--json"], None, "argument --json belongs to a subcommand (sms, doctor, simulate, tune, verify): give one first (dbo-runtime sms --json); also unrecognized: --bogus"),
        (["--total-sms", "3", "--json"], None, "argument --total-sms belongs to a subcommand (sms, simulate): give one first (dbo-runtime sms --total-sms 3)"),
        (["--json", "sms"], "dbo-runtime/sms/v1", "argument --json belongs to 'sms': give it after the subcommand (dbo-runtime sms --json)"),
        (["simulat", "--json"], None, "COMMAND='simulat' is not allowed; allowed values: 'sms', 'doctor', 'simulate', 'tune', 'verify' (did you mean 'simulate'?)"),
    ],
)
def test_every_usage_error_under_json_is_one_document_saying_what_stderr_says(
    argv: list[str], schema: str | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Wherever ``--json`` was typed, a script reading stdout gets exactly one error document, its message the
    line stderr shows (hint included)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert (doc["schema"], doc["error"]["message"], doc["exit_code"]) == (schema, message, 2)
    assert message in captured.err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["sms", "--platform", "ROCM"], "--platform='ROCM' is not allowed; allowed values: 'cuda', 'rocm' (did you mean 'rocm'?)"),
        (["sms", "--platform", "rocn"], "--platform='rocn' is not allowed; allowed values: 'cuda', 'rocm'"),
        (["simulate", "--backend", "CPU"], "--backend='CPU' is not allowed; allowed values: 'auto', 'cpu', 'deep_gemm' (did you mean 'cpu'?)"),
    ],
)
def test_a_choice_typed_in_another_case_is_offered_the_right_one(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    """A choice in capitals scores below the closeness cutoff; it is offered anyway, and a far miss still is not."""
    line = error_line(capsys, argv)
    assert line in (said, f"{said} (see dbo-runtime {argv[0]} --help)"), line


def test_help_wins_over_a_misplaced_option(capsys: pytest.CaptureFixture[str]) -> None:
    """``dbo-runtime --help --model m verify``: help is what was asked for, as argparse gives it."""
    assert main(["--help", "--model", "m", "verify"]) == 0
    assert capsys.readouterr().out.startswith("usage: dbo-runtime")
