"""Copy the local project directory to every host before a job starts."""
