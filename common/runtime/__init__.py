"""Runtime shared by every omnistage service process.

device_loop.py (DeviceLoop: the thread that drives a device; each stage supplies its runner),
server.py (ServiceRuntime: grpc.aio server, health, reflection, Control, drain), phases.py
(PhaseReporter + fault hook), status_file.py (what the launcher reads), errors.py (exceptions →
gRPC status), deadlines.py (waits that always time out with a message), stage_main.py (`main()`).
"""
