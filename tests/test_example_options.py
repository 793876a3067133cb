"""The training examples' options, run in-process on every rank: what ``--help`` promises holds,
and options that would be ignored are refused."""

import importlib.util
from pathlib import Path

import pytest

from heatlike.recipes import evaluate, load_digits_split, mlp

ROOT = Path(__file__).resolve().parent.parent


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra", [["--optimizer", "adam"], ["--non-blocking"], ["--blocking"]])
def test_digits_refuses_data_parallel_options_with_an_algorithm(comm, extra, capsys):
    """--algorithm brings its own optimizer and mode (before: these were silently ignored)."""
    with pytest.raises(SystemExit):
        _example("digits").main(["--algorithm", "sign", "--epochs", "1", *extra])
    assert "brings its own" in capsys.readouterr().err


def test_digits_with_an_algorithm_reports_every_epoch(comm, caplog):
    """Rank 0 logs loss and test accuracy per epoch with --algorithm too (before: only the
    final line), and the last epoch's accuracy is the one returned."""
    caplog.set_level("INFO", logger="heatlike.digits")
    accuracy = _example("digits").main(["--algorithm", "allreduce", "--epochs", "2",
                                        "--batch-size", "32"])
    epochs = [r.getMessage() for r in caplog.records if "test accuracy" in r.getMessage()]
    if comm.rank == 0:
        assert len(epochs) == 2, epochs
        assert epochs[-1].endswith(f"test accuracy {accuracy:.4f}")


def test_digits_with_no_epochs_reports_the_untrained_model(comm):
    """--epochs 0 evaluates the initial model (before: a placeholder 0.0)."""
    got = _example("digits").main(["--epochs", "0"])
    _, _, x_test, y_test = load_digits_split(0)
    assert got == evaluate(mlp([64, 128, 64, 10], 0).eval(), x_test, y_test, comm)


@pytest.mark.parametrize("option", ["--save-every", "--stop-after", "--kill-at", "--epochs"])
def test_resume_refuses_negative_counts(comm, option, capsys, tmp_path):
    """A negative count is an error (before: --save-every -1 saved at every step)."""
    with pytest.raises(SystemExit):
        _example("resume").main([option, "-1", "--checkpoint", str(tmp_path / "x.ckpt")])
    assert "must be 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--epochs", "-1"], ["--batch-size", "0"], ["--lr", "0"]])
def test_digits_refuses_out_of_range_settings(comm, option, capsys):
    """(before: --epochs -1 trained nothing and printed a test accuracy of 0.0000 that was never
    measured)."""
    with pytest.raises(SystemExit):
        _example("digits").main(option)
    assert "--epochs must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-0.05", "nan", "inf"])
def test_resume_refuses_a_learning_rate_out_of_range(comm, value, capsys, tmp_path):
    """(before: --lr 0 trained nothing, --lr nan gave NaN weights, both reported an accuracy)"""
    with pytest.raises(SystemExit):
        _example("resume").main(["--lr", value, "--checkpoint", str(tmp_path / "x.ckpt")])
    assert "must be a number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("options", [["--epochs", "3"], ["--epochs", "0"], ["--warmup", "-1"],
                                     ["--batch-size", "0"], ["--lr", "nan"]])
def test_daso_digits_refuses_settings_daso_cannot_train_with(comm, options, capsys):
    """A usage error naming the options (before: a traceback from DASO's constructor in its
    parameter names, or NaN weights for --lr nan)."""
    with pytest.raises(SystemExit):
        _example("daso_digits").main(options)
    assert "--" in capsys.readouterr().err
