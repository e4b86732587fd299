"""DBCache: an SQLite sample store for fixed validation sets."""
