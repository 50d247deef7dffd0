"""Small helpers (torch-free, but for ``trees``) that every layer imports downward: atomic files, config paths, plugin settings,
reason codes, the strict rule's name, token-count meanings, tree structure, the optional extras and the Hub's reachability (hub).
This package imports nothing; import the module you need."""
