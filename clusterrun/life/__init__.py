"""A job's life as one owner sees it: the checks before a start, the start, the verified stop, restarts, notices."""
