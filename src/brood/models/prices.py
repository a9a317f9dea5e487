"""What a model call costs, in dollars: the user's prices, else what the model itself
reported, else the price `genai-prices` knows for its provider and model; else unknown
(None, never 0: a cost nobody knows is not a call that was free).

`genai-prices` is imported on the first lookup (its tables are a large module), and each
(provider, model) is looked up there once per process: an unknown one is remembered as
unknown, so a tree of a thousand calls to an unpriced model asks once.

How usage adds up when a cost may be unknown (`add_usage`, `add_cost`) is brood.lifecycle's,
beside the run record whose usage it is (the flow package and the journal's readers add
usage too, and import nothing of the models).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from brood.errors import InvalidArgument

PRICE_FORM = "IN,OUT (dollars per million input and output tokens, e.g. 0.15,0.6)"
# The counts of a run's usage; `cost` adds apart (None is unknown, and stays so only while
# nothing known is added to it).
PER_MILLION = 1_000_000
# A model's `provider` where genai-prices names it otherwise (Gemini's prices are Google's).
CATALOG_IDS = {"gemini": "google"}


@dataclass(frozen=True)
class Price:
    """A model's price in dollars per million tokens: `input` for the prompt, `output`
    for the reply. Each is a finite number >= 0."""

    input: float
    output: float

    def __post_init__(self) -> None:
        for name in ("input", "output"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise InvalidArgument(
                    f"Price({name}=...) must be dollars per million tokens, a number >= 0, "
                    f"got {value!r}"
                )
            object.__setattr__(self, name, float(value))

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """Dollars for a call of these tokens."""
        return (input_tokens * self.input + output_tokens * self.output) / PER_MILLION


def as_price(value: object, where: str) -> Price:
    """A Price from a Price or an `(input, output)` pair; InvalidArgument naming `where`."""
    if isinstance(value, Price):
        return value
    if isinstance(value, tuple | list) and len(value) == 2:
        try:
            return Price(value[0], value[1])
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc}") from None
    raise InvalidArgument(
        f"{where} must be a brood.Price(input, output) or an (input, output) pair of "
        f"dollars per million tokens, got {value!r}"
    )


def parse_price(text: str, option: str = "--price") -> tuple[str | None, Price]:
    """`IN,OUT` (the price of the command's own model: None for its name) or
    `MODEL=IN,OUT`, as a command line gives it; InvalidArgument naming `option` and the
    form."""
    name, sep, numbers = text.rpartition("=")
    parts = numbers.split(",")
    fix = f"write {option} {PRICE_FORM}, or {option} MODEL=IN,OUT for another model"
    if sep and not name.strip():
        raise InvalidArgument(f"{option} {text!r} names no model before '='; {fix}")
    if len(parts) != 2:
        raise InvalidArgument(f"{option} {text!r} is not two numbers; {fix}")
    try:
        pair = [float(p) for p in parts]
    except ValueError:
        raise InvalidArgument(f"{option} {text!r} holds something that is not a number; {fix}")
    if not all(math.isfinite(p) and p >= 0 for p in pair):
        raise InvalidArgument(f"{option} {text!r}: a price is a number >= 0; {fix}")
    return (name.strip() or None), Price(pair[0], pair[1])


def price_table(prices: Mapping[str, Any] | None) -> dict[str, Price]:
    """The user's prices by model name, each checked (InvalidArgument naming the model)."""
    if prices is None:
        return {}
    if not isinstance(prices, Mapping):
        raise InvalidArgument(
            "prices must be a mapping of model names to brood.Price(input, output) (or "
            f"(input, output) pairs), got {type(prices).__name__}"
        )
    table = {}
    for name, value in prices.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"prices: a key is a model name, got {name!r}")
        table[name] = as_price(value, f"prices[{name!r}]")
    return table


# ---- genai-prices ---------------------------------------------------------------------------
_known: dict[tuple[str, str], bool] = {}  # (provider, model) -> whether genai-prices knows it


def catalog_cost(provider: str, model: str, input_tokens: int, output_tokens: int) -> float | None:
    """Dollars for a call as `genai-prices` prices it, or None for a model it does not
    know (remembered: asked once per process)."""
    key = (provider, model)
    if _known.get(key) is False:
        return None
    from genai_prices import Usage, calc_price

    try:
        priced = calc_price(
            Usage(input_tokens=input_tokens, output_tokens=output_tokens),
            model_ref=model,
            provider_id=CATALOG_IDS.get(provider, provider),
        )
    except LookupError:
        _known[key] = False
        return None
    _known[key] = True
    return float(priced.total_price)


class Pricing:
    """The prices one supervisor uses: the user's (by model name) first, then a model's
    own report, then `genai-prices` for a model with a provider."""

    def __init__(self, prices: Mapping[str, Any] | None = None) -> None:
        self.table = price_table(prices)

    def cost(
        self,
        provider: str | None,
        name: str | None,
        input_tokens: int,
        output_tokens: int,
        reported: float | None,
    ) -> float | None:
        """The cost of one call of model `name` (of `provider`), which reported `reported`
        (None: it did not say); None when nobody knows it."""
        if name is not None and name in self.table:
            return self.table[name].cost(input_tokens, output_tokens)
        if reported is not None:
            try:
                value = float(reported)
            except (TypeError, ValueError):
                value = math.nan
            if math.isfinite(value):
                return max(0.0, value)  # a model's own count is trusted, never below zero
        if provider is None or not name:
            return None
        return catalog_cost(provider, name, input_tokens, output_tokens)

    def cold(self, provider: str | None, name: str | None) -> bool:
        """Whether a call of this model would look genai-prices up for the first time."""
        return (
            provider is not None
            and bool(name)
            and name not in self.table
            and ((provider, str(name)) not in _known)
        )

    def warm(self, provider: str | None, name: str | None) -> None:
        """Look a model up before its first call, so that the import of genai-prices (about
        a second) and its first search are paid here, in the caller's thread, not on the
        supervisor's loop."""
        if provider is not None and name and self.cold(provider, name):
            catalog_cost(provider, name, 0, 0)


def cost_text(usage: Mapping[str, Any]) -> str:
    """A usage's cost for people: `$0.0123`, `$0.0123 + 2 unpriced calls`, `cost unknown`
    (no call priced), or `$0` before any call."""
    cost = usage.get("cost")
    unpriced = int(usage.get("unpriced_calls") or 0)
    if cost is None:
        return "cost unknown" if unpriced or usage.get("model_calls") else "$0"
    text = dollars(float(cost))
    if unpriced:
        text += f" + {unpriced} unpriced call{'s' * (unpriced != 1)}"
    return text


def dollars(value: float) -> str:
    """`$1.25` from a dollar up; below it four significant digits, never in exponent
    form (`$0.00804`, `$0.000042`)."""
    if value <= 0:
        return "$0"
    if value >= 1:
        return f"${value:,.2f}"
    decimals = min(3 - math.floor(math.log10(value)), 12)
    return "$" + (f"{value:.{decimals}f}".rstrip("0").rstrip(".") or "0")


__all__ = [
    "PRICE_FORM",
    "Price",
    "Pricing",
    "as_price",
    "catalog_cost",
    "cost_text",
    "dollars",
    "parse_price",
    "price_table",
]
