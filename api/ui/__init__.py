"""The run dashboard's front end: server-rendered pages and one vanilla-JS renderer shared by
the live pages (api/routers/ui.py) and the static report (report.py)."""
