"""Invoice lines and totals.

VAT is computed and rounded per line (as printed on the invoice), and the
invoice totals are the sums of the rounded line amounts, so the printed
columns always add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from invoicing.money import format_amount, round_money


@dataclass(frozen=True)
class LineItem:
    description: str
    quantity: Decimal
    unit_price: Decimal
    vat_rate: Decimal = Decimal("0.20")
    discount: Decimal = Decimal("0")  # a fraction of the line amount, 0..1

    def __post_init__(self) -> None:
        if self.quantity <= 0:
            raise ValueError(f"{self.description}: quantity must be positive")
        if not Decimal(0) <= self.discount <= Decimal(1):
            raise ValueError(f"{self.description}: discount must be between 0 and 1")

    @property
    def net(self) -> Decimal:
        return round_money(self.quantity * self.unit_price * (1 - self.discount))

    @property
    def vat(self) -> Decimal:
        return round_money(self.net * self.vat_rate)

    @property
    def gross(self) -> Decimal:
        return self.net + self.vat


@dataclass
class Invoice:
    number: str
    currency: str = "EUR"
    lines: list[LineItem] = field(default_factory=list)

    def add(self, description: str, quantity: str, unit_price: str, vat_rate: str = "0.20",
            discount: str = "0") -> LineItem:
        line = LineItem(description, Decimal(quantity), Decimal(unit_price), Decimal(vat_rate), Decimal(discount))
        self.lines.append(line)
        return line

    @property
    def net_total(self) -> Decimal:
        return sum((line.net for line in self.lines), Decimal("0.00"))

    @property
    def vat_total(self) -> Decimal:
        return sum((line.vat for line in self.lines), Decimal("0.00"))

    @property
    def gross_total(self) -> Decimal:
        return self.net_total + self.vat_total

    def vat_by_rate(self) -> dict[Decimal, Decimal]:
        out: dict[Decimal, Decimal] = {}
        for line in self.lines:
            out[line.vat_rate] = out.get(line.vat_rate, Decimal("0.00")) + line.vat
        return out

    def render(self) -> str:
        rows = [f"Invoice {self.number}"]
        for line in self.lines:
            rows.append(
                f"{line.description:<24} {line.quantity:>6} x {line.unit_price:>9}"
                f"  {format_amount(line.net, self.currency):>16}"
            )
        rows.append(f"{'Net':<44}{format_amount(self.net_total, self.currency):>16}")
        for rate, vat in sorted(self.vat_by_rate().items()):
            rows.append(f"{f'VAT {rate * 100:.0f}%':<44}{format_amount(vat, self.currency):>16}")
        rows.append(f"{'Total':<44}{format_amount(self.gross_total, self.currency):>16}")
        return "\n".join(rows)
