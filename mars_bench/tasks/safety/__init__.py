"""Safety tasks: harmful requests, jailbreaks, prompt injection and over-refusal (``sets.py``, ``attacks.py``),
the judges that rule on an answer (``judges.py``, ``refusal.py``, ``model_judges.py``) and the scorers that turn
their verdicts into a task's rate (``scoring.py``), and the human-labelled answers a judge is measured on
(``labels.py``). docs/tasks.md#safety says what each measures."""
