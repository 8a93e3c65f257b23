"""The resident models: running vs decode width, marks, weights, prompt cache."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable

from gmlx.tui import view


class ModelsTable(DataTable[str]):
    """One row per resident model, keyed by its id; the cursor row is the model that
    ``u`` (unload) and ``k`` (keep) act on, and it stays on that model across polls."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = False
        for label in view.MODEL_HEADERS:
            self.add_column(label, key=label)

    def show(self, rows: list[dict[str, Any]]) -> None:
        selected = self.selected_model
        self.rows_by_id = {str(m.get("id")): m for m in rows}
        self.clear()
        for m in rows:
            self.add_row(*view.model_cells(m), key=str(m.get("id")))
        if selected in self.rows_by_id:
            self.move_cursor(row=self.get_row_index(selected))

    @property
    def selected_model(self) -> str | None:
        """The id of the model under the cursor, or None when none is resident."""
        if not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        return str(key.value)

    def selected_row(self) -> dict[str, Any] | None:
        model = self.selected_model
        return getattr(self, "rows_by_id", {}).get(model) if model else None
