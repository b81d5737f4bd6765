"""README snippets run as written: each Python snippet stands alone (it compiles and every name it uses
is imported or defined in it: ruff's undefined-name check), and every file a snippet or command reads
is one the repository ships or `make demo` writes. Also: `make demo`'s install says what it is doing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEMO = ROOT / "common" / "demo.py"
DEMO_OUT = "demo-output/"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_every_python_snippet_compiles_and_imports_what_it_uses(tmp_path):
    snippets = blocks("python")
    assert len(snippets) >= 6
    for i, code in enumerate(snippets):
        compile(code, f"README python snippet {i}", "exec")
        (tmp_path / f"snippet_{i}.py").write_text(code)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "F821,F822,F823",
            ".",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, "a README snippet uses a name it does not define:\n" + result.stdout


def read_files() -> set[str]:
    """Files the snippets and commands read: open(..., "rb"), images=[...], --image/--audio/--video,
    and the deploy files `serve` is given."""
    text = "\n".join(blocks("python") + blocks("bash"))
    found = set(re.findall(r'open\("([^"]+)", "rb"\)', text))
    found |= set(re.findall(r'(?:images|audios|videos)=\["([^"]+)"\]', text))
    found |= set(re.findall(r"--(?:image|audio|video) (\S+)", text))
    found |= set(re.findall(r"\b(deploy/[\w./-]+\.ya?ml)\b", text))
    return found


def test_every_file_a_snippet_reads_is_shipped_or_written_by_the_demo():
    demo = DEMO.read_text()
    files = read_files()
    assert "demo-output/demo-image.png" in files and "deploy/local-tiny.yaml" in files  # the scan sees them
    missing = []
    for name in sorted(files):
        if name.startswith(DEMO_OUT):
            if f'"{name.removeprefix(DEMO_OUT)}"' not in demo:  # the demo writes it into --out demo-output
                missing.append(name)
        elif not (ROOT / name).is_file():
            missing.append(name)
    assert not missing, f"README reads files nobody has: {missing}"
    assert "--out demo-output" in (ROOT / "Makefile").read_text()


def test_make_demo_says_what_each_install_step_is_doing():
    """`make -n -B install` (nothing runs): every pip install is announced by a line of its own first."""
    result = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    lines = result.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if "pip install" in line]
    assert result.returncode == 0 and len(installs) >= 3
    for i in installs:
        assert lines[i - 1].startswith("echo ") and "make: [" in lines[i - 1], lines[i]
