"""`snapforensics explore`: the query layer (queries.py), its HTTP JSON API (server.py) and the
page that draws it (static/)."""
