"""The README's examples run as written (the S3 one against the loopback server)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_starts_with_the_two_setup_commands():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL).group(1)
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_quick_start_runs(capsys):
    exec(compile(python_blocks()[0], "README quick start", "exec"), {})
    assert capsys.readouterr().out.strip() == "256 torch.Size([32, 8])"


def test_bucket_example_runs(s3_server, capsys):
    import s3fs

    source = python_blocks()[1].replace("http://127.0.0.1:9000", s3_server)
    fs = s3fs.S3FileSystem(endpoint_url=s3_server, key="testing", secret="testing",
                           skip_instance_cache=True)
    if not fs.exists("my-bucket"):
        fs.mkdir("my-bucket")
    exec(compile(source, "README bucket example", "exec"), {})
    assert capsys.readouterr().out.strip() == "torch.Size([2, 64]) 1"


def test_compressed_example_runs(capsys):
    exec(compile(python_blocks()[2], "README compressed example", "exec"), {})
    assert capsys.readouterr().out.strip() == "torch.Size([32, 4, 84, 84]) True"


def test_torchrl_example_runs(capsys):
    pytest.importorskip("torchrl")
    exec(compile(python_blocks()[3], "README TorchRL example", "exec"), {})
    assert capsys.readouterr().out.strip().splitlines()[-1] == "torch.Size([32, 4])"


def test_checkpoint_example_runs(capsys):
    exec(compile(python_blocks()[4], "README checkpoint example", "exec"), {})
    assert capsys.readouterr().out.split() == ["True", "True", "50500", "True"]


def test_dataset_example_runs(capsys):
    exec(compile(python_blocks()[5], "README dataset example", "exec"), {})
    assert capsys.readouterr().out.strip() == "4 torch.Size([4, 50, 11])"


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if "://" not in target:
            assert (README.parent / target).exists(), target
