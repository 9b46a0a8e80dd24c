"""The feature probes' answers kept on disk per torch build (``probe_memo``)."""
import json

import pytest

from compile_core.torch_support import probe_memo


@pytest.fixture
def memo(tmp_path, monkeypatch):
    """A fresh memo in ``tmp_path`` (the process's own root and answers put back after)."""
    monkeypatch.setattr(probe_memo, "_root", [None])
    monkeypatch.setattr(probe_memo, "_answers", None)
    probe_memo.use(tmp_path)
    return tmp_path / probe_memo.FILE


def _counted(answer):
    calls = []

    def feature_probe():
        calls.append(1)
        return answer
    return calls, feature_probe


def test_a_yes_is_kept_and_a_restart_skips_the_probe(memo, monkeypatch):
    calls, probe = _counted(True)
    assert probe_memo.remembered(probe)() is True and len(calls) == 1
    assert json.loads(memo.read_text()) == {probe_memo.build_key(): {"test_probe_memo.feature_probe": True}}
    monkeypatch.setattr(probe_memo, "_answers", None)  # a restarted process reads the file
    assert probe_memo.remembered(probe)() is True and len(calls) == 1


def test_a_no_is_not_kept_so_the_next_start_probes_again(memo, monkeypatch):
    calls, probe = _counted(False)
    assert probe_memo.remembered(probe)() is False
    monkeypatch.setattr(probe_memo, "_answers", None)
    assert probe_memo.remembered(probe)() is False and len(calls) == 2
    assert not memo.exists()


def test_answers_of_another_torch_build_or_probe_source_are_not_used(memo, monkeypatch):
    memo.write_text(json.dumps({"another build": {"test_probe_memo.feature_probe": True}}))
    monkeypatch.setattr(probe_memo, "_answers", None)
    calls, probe = _counted(False)
    assert probe_memo.remembered(probe)() is False and len(calls) == 1


def test_the_key_changes_with_the_probes_source(monkeypatch, tmp_path):
    key = probe_memo.build_key()
    probe_memo.build_key.cache_clear()
    monkeypatch.setattr(probe_memo.torch, "__version__", "9.9.9")
    try:
        assert probe_memo.build_key() != key
    finally:
        probe_memo.build_key.cache_clear()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"%s": "yes"}'])
def test_a_damaged_file_is_ignored_and_the_probe_runs(memo, pack_log, monkeypatch, text):
    memo.write_text(text.replace("%s", probe_memo.build_key()))
    monkeypatch.setattr(probe_memo, "_answers", None)  # read at the next probe
    monkeypatch.setattr(probe_memo.log, "_first_time", lambda key: True)
    calls, probe = _counted(True)
    assert probe_memo.remembered(probe)() is True and len(calls) == 1
    said = [i for i in pack_log.infos() if "could not be read" in i]
    assert len(said) == (1 if text == "{not json" else 0), pack_log.infos()


def test_an_unwritable_folder_costs_one_line_and_the_answer_stands(tmp_path, monkeypatch, pack_log):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(probe_memo, "_root", [blocker / "sub"])  # a folder under a file
    monkeypatch.setattr(probe_memo, "_answers", None)
    monkeypatch.setattr(probe_memo.log, "_first_time", lambda key: True)
    calls, probe = _counted(True)
    assert probe_memo.remembered(probe)() is True
    assert any("could not be kept" in i for i in pack_log.infos()), pack_log.infos()


def test_the_real_probes_go_through_the_memo():
    from compile_core.torch_support import torch_compat
    assert torch_compat.compile_works.probe.__name__ == "compile_works"
