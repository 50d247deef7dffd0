"""Models: where their weights come from (``sources``), how they load (``loading``), where their modules
go (``placement``), and their KV caches (``kvcache``). Import the module you need; this package imports
nothing, so that ``sources`` can be used without loading torch's model code."""
