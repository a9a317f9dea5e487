"""Confinement: model code runs in a worker that cannot read your files, reach the network
or outlive its run; `Limits(fs_read=...)` lets it read a path you name. A scripted model
stands in for one that tries.

    python examples/confinement.py
"""

import tempfile
from pathlib import Path

import brood

FENCE = "`" * 3
secret = Path(tempfile.mkdtemp()) / "notes.txt"
secret.write_text("the launch code is 0000\n")


def curious(messages, model=None):
    """A model that tries to read a file outside its scratch, and reports what happened."""
    code = (
        "try:\n"
        f"    FINAL('read: ' + open({str(secret)!r}).read().strip())\n"
        "except OSError as exc:\n"
        "    FINAL(f'refused: {type(exc).__name__}')\n"
    )
    return f"{FENCE}repl\n{code}{FENCE}"


with brood.Supervisor(curious) as sup:
    print("confined:", sup.run("read the notes").answer)
with brood.Supervisor(curious, limits=brood.Limits(fs_read=(str(secret.parent),))) as sup:
    print("with fs_read:", sup.run("read the notes").answer)
