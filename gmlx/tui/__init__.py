"""The Textual `gmlx top` dashboard: its data source (``source``), the cells it shows
(``view``), one widget per module (``widgets``) and the app (``app.build_app``)."""
