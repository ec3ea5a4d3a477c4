"""Random input at the C API and the loaders (the strategies and checks of tests/fuzzing.py,
fuzz_scores.py and fuzz_inputs.py), derandomized and sized
so the file runs in well under a minute; benchmarks/fuzz.py runs the same with more examples.
Never a crash or abort; every refusal raises the documented error and leaves the cache as it was."""
import pytest

import fuzz_inputs as FI
import fuzz_scores as FS
import fuzzing as F


@pytest.fixture(scope="module")
def target(synth_models):
    return F.Target(synth_models["llama-r3"])


@pytest.fixture(scope="module")
def observer(synth_models):
    return FS.ObserverTarget(synth_models["qwen2-r2"], n_ctx=256)


def test_random_keep_lists_compact_like_the_oracle_or_change_nothing(target):
    kinds = F.explore(F.keep_lists(target.geo.n_slots, target.geo.kv_size),
                      lambda *case: F.check_compact(target, *case), 150)
    assert kinds["ok"] >= 10 and len(kinds) >= 6, kinds      # both sides of the contract were exercised


def test_random_scores_and_parameters_for_the_c_selector():
    kinds = F.explore(FS.selector_cases(), FS.check_selector, 300)
    assert kinds["ok"] >= 50 and {"INVALID_ARG", "LIST_LENGTH", "PYTHON"} <= set(kinds), kinds


def test_random_observer_windows_toggles_and_decodes(observer):
    kinds = F.explore(FS.observer_ops(), lambda *case: FS.check_observer(observer, *case), 60)
    assert any("INVALID_ARG" in k for k in kinds) and any("ok" in k for k in kinds), kinds


@pytest.fixture(scope="module")
def saved(synth_models, tmp_path_factory):
    return FI.SessionTarget(synth_models["llama-r3"], tmp_path_factory.mktemp("sessions"))


def test_damaged_session_files_are_refused_or_load_exactly(saved):
    kinds = F.explore(FI.damaged_files(saved.data, saved.marks), lambda *case: FI.check_damaged(saved, *case), 100)
    assert sum(v for k, v in kinds.items() if k.endswith("SessionError")) >= 50, kinds


def test_re_signed_states_that_do_not_fit_are_refused(saved):
    for defect in FI.RESIGNED:                 # every kind, two magnitudes (benchmarks/fuzz.py: random ones)
        for seed in (0, 1):
            assert FI.check_resigned(saved, defect, seed) == defect


def test_random_command_lines_end_in_an_answer_or_one_line(tmp_path_factory):
    t = FI.CLIFiles(tmp_path_factory.mktemp("cli"))
    kinds = F.explore(FI.cli_args(t), FI.check_cli, 30)
    assert kinds["ok"] >= 2 and sum(kinds.values()) - kinds["ok"] >= 20, kinds


def test_random_true_position_tables_for_restore(target):
    kinds = F.explore(F.restore_tables(target.geo.n_slots), lambda tp: F.check_restore(target, tp), 100)
    assert kinds["ok"] >= 10 and {"INVALID_ARG", "CELL_ORDER", "CELL_NOT_IN_SEQ", "PYTHON"} <= set(kinds), kinds
