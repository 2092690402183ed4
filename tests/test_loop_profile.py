"""``benchmarks/loop_profile.py``'s reading of py-spy's samples: which of a rank's samples in the
trainer's loop are the harness's, which the calls the ledger wraps, and its other threads'."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
_spec = importlib.util.spec_from_file_location("loop_profile", REPO / "benchmarks" / "loop_profile.py")
loop_profile = importlib.util.module_from_spec(_spec)
sys.modules["loop_profile"] = loop_profile  # its dataclass looks its module up
_spec.loader.exec_module(loop_profile)

RANK = 'process 2:"python -m harness.rank /tmp/run"'
MAIN = f'process 1:"";{RANK};<module> (harness/rank/__main__.py:5);main (harness/rank/entry.py:238)'
LOOP = f"{MAIN};train (mlx_lm/tuner/trainer.py:331)"
SAMPLER = f'process 1:"";{RANK};Thread._bootstrap (threading.py:1002);MemorySampler._run (harness/memory/sampler.py'


def test_the_rank_samples_in_the_trainers_loop_are_split_into_the_harnesss_and_the_wrapped_calls() -> None:
    wrapped = loop_profile.wrapped_lines()
    call = sorted(wrapped)[0]
    lines = [
        f"{LOOP} 900",  # waiting in the trainer's evaluation
        f"{LOOP};Report.on_train_loss_report (harness/trainers/mlx_lm/rank.py:184);dumps (json/__init__.py:231) 7",
        f"{LOOP};Ledger.compile.<locals>.call ({call}) 50",  # the compiled step, called through the ledger
        f"{LOOP};Ledger.compile.<locals>.call (harness/rank/ledger.py:1);"
        f"Ledger.compile.<locals>.traced (harness/rank/ledger.py:2);step (mlx_lm/tuner/trainer.py:249) 4",
        f"{MAIN};build_model (harness/rank/models.py:84) 30",  # before the loop
        f"{SAMPLER}:90);wait (threading.py:331) 500",  # the sampler waiting
        f"{SAMPLER}:95) 3",  # the sampler sampling
        'process 1:"";<module> (benchmarks/observer_effect.py:12) 40',  # the parent, not a rank
        "a torn line",
    ]
    share = loop_profile.read_raw(lines, "mlx_lm", wrapped)
    assert (share.samples, share.loop, share.harness, share.tracing, share.wrapped) == (1494, 961, 11, 4, 50)
    assert (share.threads, share.threads_busy) == (503, 3)
    text = loop_profile.report(share, "mlx_lm")
    assert "in the harness's frames 11 (1.14 %), 4 of them while mx.compile traced" in text
    assert "Report.on_train_loss_report" in text.splitlines()[1]
    assert share.deepest == {"dumps (json/__init__.py:231)": 7}  # the traced step's samples left out
    assert text.splitlines()[-1].endswith("7  dumps (json/__init__.py:231)")
    assert "did its rank train?" in loop_profile.report(loop_profile.read_raw(lines[-3:], "mlx_lm", wrapped), "mlx_lm")


def test_the_wrapped_lines_are_the_ledgers_calls_of_what_it_wraps() -> None:
    source = (REPO / "harness" / "rank" / "ledger.py").read_text().splitlines()
    lines = loop_profile.wrapped_lines()
    assert len(lines) >= 2
    for at in lines:
        line = source[int(at.rsplit(":", 1)[1]) - 1]
        assert "compiled(*a, **kw)" in line or "_original(*args, **kwargs)" in line


def test_the_scripts_loop_is_its_mains_lines_from_its_steps_to_its_finish() -> None:
    loop = loop_profile.script_loop()
    source = (REPO / "examples" / "ddp_train.py").read_text().splitlines()
    assert source[loop.start - 1].strip().startswith("for step in") and "run.finish(" in source[loop.stop - 1]
    main = f"{MAIN};<module> (benchmarks/timed_script.py:90)"
    lines = [f"{main};main (ddp_train.py:{loop.start - 10});Session.model (harness/rank/script_session.py:45) 30",
             f"{main};main (ddp_train.py:{loop.start + 1});Session.step (harness/rank/script_session.py:146) 5",
             f"{main};main (ddp_train.py:{loop.start + 2}) 95"]
    share = loop_profile.read_raw(lines, "script", set())
    assert (share.samples, share.loop, share.harness) == (130, 100, 5)  # the model built before the loop left out
