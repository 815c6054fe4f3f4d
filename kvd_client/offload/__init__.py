"""The engine-neutral offload session and its parts: lookups, loads and stores on the scheduler thread, the trackers that remember them, and the daemon's answers applied."""
