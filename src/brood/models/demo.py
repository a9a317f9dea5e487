"""The script of `brood demo`: a root that fans work out to children without blocking.

The replies are code, so the counting is real: each child counts the sightings in the
section of the bundled field notes it was given.
"""

from __future__ import annotations

ROOT_TASK = "Survey the field notes in `context`: count sightings per site, name the busiest."

DEMO_SCRIPT: dict[str, list[str]] = {
    "Survey the field notes": [
        # Step 1: one child per site, started without waiting, plus a slow watcher.
        """Each site is a section. I start one child per site and keep working.
```repl
sections = [s for s in context.split("\\n## ")[1:]]
sites = [s.splitlines()[0] for s in sections]
handles = [rlm_spawn(f"Count the sightings at site {name}", context=sec)
           for name, sec in zip(sites, sections)]
watcher = rlm_spawn("Watch the notes for late reports")
print([rlm_status(h) for h in handles])
```""",
        # Step 2: independent work while the children run.
        """While they count, I measure the notes myself.
```repl
words = len(context.split())
print(f"{len(sites)} sites, {words} words; children: {[rlm_status(h) for h in handles]}")
```""",
        # Step 3: collect the counts; the watcher is not needed any more.
        """```repl
counts = rlm_wait_all(handles, timeout=60)
print(counts)
print("watcher:", rlm_cancel(watcher))
```""",
        """```repl
pairs = [c.rsplit(": ", 1) for c in counts]
best = max(pairs, key=lambda p: int(p[1]))
FINAL(f"{sum(int(n) for _, n in pairs)} sightings at {len(pairs)} sites; "
      f"busiest: {best[0]} ({best[1]}). Per site: " + ", ".join(counts))
```""",
    ],
    "Count the sightings at site": [
        """```repl
site = context.splitlines()[0].strip()
n = context.count("sighting:")
FINAL(f"{site}: {n}")
```""",
    ],
    "Watch the notes for late reports": [
        """No late reports yet; I keep watching.
```repl
import time
while True:
    time.sleep(0.5)
```""",
    ],
}
