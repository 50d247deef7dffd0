"""One sweep cell: paired runs, records, manifest and summary."""
