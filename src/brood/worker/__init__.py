"""Worker side: runs in worker processes; imports `brood.protocol`, never the supervisor side."""
