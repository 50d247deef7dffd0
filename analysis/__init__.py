"""Analysis of tidy records: tables (and, later, figures). Reads records only; never imports torch."""
