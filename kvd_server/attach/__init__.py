"""The attach socket: the daemon's side of kvd_proto.attach (peer credentials, descriptors passed with SCM_RIGHTS) and its answers role by role."""
