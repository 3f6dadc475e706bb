"""The driver's side of a run: the ``Runtime`` that starts the ranks (Ray actors, or threads of
this process), hands them steps, watches them and merges what they return."""
