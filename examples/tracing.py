"""OpenTelemetry spans of a tree: a span per run (a child's under its parent's), per model
call and per REPL step, collected here in memory (the [otel] extra; point the standard
OTEL_* variables at a collector instead to send them on). The echo model needs no server.

    python examples/tracing.py
"""

from collections import Counter

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import brood

spans = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(spans))

with brood.Supervisor("echo", tracing=provider) as sup:
    result = sup.run("Count the words", context=["a b c", "d e"])
    print(result.state, result.answer)

finished = spans.get_finished_spans()
runs = [s for s in finished if s.name == "brood.run"]
root = next(s for s in runs if s.parent is None)
children = [s for s in runs if s.parent is not None and s.parent.span_id == root.context.span_id]
print("runs:", len(runs), "children under the root's span:", len(children))
print(sorted(Counter(s.name.split()[0] for s in finished).items()))
