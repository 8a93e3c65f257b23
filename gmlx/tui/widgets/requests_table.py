"""The live requests, sortable by any column (click its header, or ``s`` / ``r``)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from gmlx.tui import view


class RequestsTable(DataTable[Any]):
    """One row per live request, keyed by its id, filtered by ``model_filter`` and
    sorted by ``sort_key`` (None: the server's order, queued first). The cursor stays
    on the same request across polls while it lives."""

    sort_key: reactive[str | None] = reactive(None)
    reverse: reactive[bool] = reactive(False)
    model_filter: reactive[str] = reactive("")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.live: list[dict[str, Any]] = []

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.render_rows()

    def show(self, rows: list[dict[str, Any]]) -> None:
        self.live = rows
        self.render_rows()

    def watch_sort_key(self) -> None:
        self.render_rows()

    def watch_reverse(self) -> None:
        self.render_rows()

    def watch_model_filter(self) -> None:
        self.render_rows()

    def sort_next(self) -> None:
        """Sort by the next column (after the last one: the server's order again)."""
        keys = (*view.COLUMN_KEYS, None)
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        # A second click on the sorted column flips its direction.
        key = str(event.column_key.value)
        if key == self.sort_key:
            self.reverse = not self.reverse
        else:
            self.sort_key = key
        event.stop()

    def _label(self, column: view.Column) -> Text:
        arrow = (" ▼" if self.reverse else " ▲") if column.key == self.sort_key else ""
        return Text(column.label + arrow, justify="right" if column.right else "left")

    def render_rows(self) -> None:
        if not self.is_mounted:
            return
        selected = self.selected_request
        self.clear(columns=True)
        for column in view.REQUEST_COLUMNS:
            self.add_column(self._label(column), key=column.key)
        shown = view.request_rows(
            self.live, sort_key=self.sort_key, reverse=self.reverse, model_filter=self.model_filter
        )
        for row in shown:
            cells = [
                Text(cell, justify="right" if c.right else "left")
                for c, cell in zip(view.REQUEST_COLUMNS, view.request_cells(row), strict=True)
            ]
            self.add_row(*cells, key=str(row.get("id")))
        if selected is not None and selected in {str(r.get("id")) for r in shown}:
            self.move_cursor(row=self.get_row_index(selected))

    @property
    def selected_request(self) -> str | None:
        """The full id of the request under the cursor, or None when there is none."""
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
