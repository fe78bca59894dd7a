"""ForkServe on Ray Serve: several engine replicas behind tree-sticky, adapter-aware routing.

deployments.build_application / build_app (config files) assemble the application;
launcher.main is ``forkserve serve --replicas N``. docs/SCALE_OUT.md explains the design.
"""
