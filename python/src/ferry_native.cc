// ferry._native: the transfer engine (include/ferry/agent.h) for Python, through pybind11.
// The Pythonic surface (ferry.Agent, ferry.Descriptor, the exception classes) is defined here;
// python/ferry/__init__.py re-exports it. Every call that can block or copy releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/host_port.h"
#include "ferry/agent.h"
#include "ferry/status.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

// --- errors --------------------------------------------------------------------------------------

// ferry.Error and one subclass per status code, created at import.
std::map<Code, PyObject*>& ErrorClasses() {
    static std::map<Code, PyObject*> classes;
    return classes;
}
PyObject* base_error = nullptr;

[[noreturn]] void Raise(const Status& st) {
    PyObject* cls = base_error;
    auto it = ErrorClasses().find(st.code());
    if (it != ErrorClasses().end()) cls = it->second;
    py::object e =
        py::reinterpret_steal<py::object>(PyObject_CallFunction(cls, "s", st.message().c_str()));
    if (!e) throw py::error_already_set();
    e.attr("code") = std::string(CodeName(st.code()));
    e.attr("message") = std::string(st.message());
    PyErr_SetObject(cls, e.ptr());
    throw py::error_already_set();
}

void Check(const Status& st) {
    if (!st.ok()) Raise(st);
}
template <typename T>
T Take(Result<T> r) {
    if (!r.ok()) Raise(r.status());
    return std::move(r).value();
}

std::chrono::milliseconds Millis(std::optional<double> seconds, double fallback) {
    double s = seconds.value_or(fallback);
    if (!(s >= 0) || s > 1e7) {
        throw py::value_error("timeout must be a number of seconds between 0 and 1e7");
    }
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// --- regions -------------------------------------------------------------------------------------

// A registered region. Holds what keeps its memory alive: the Python object (and, for a buffer,
// the exported Py_buffer, so a bytearray cannot be resized under a peer's WRITE) until the
// region is deregistered.
struct Region {
    RegionInfo info;
    py::object owner;  // None for agent-allocated and (ptr, len) regions
    std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> view{nullptr, [](Py_buffer* b) {
                                                              PyBuffer_Release(b);
                                                              delete b;
                                                          }};
    bool allocated = false;
    bool registered = true;
};

RegionId RegionIdOf(const py::handle& h) {
    if (py::isinstance<Region>(h)) return h.cast<std::shared_ptr<Region>>()->info.id;
    return h.cast<RegionId>();
}

// --- transfers -----------------------------------------------------------------------------------

struct PyTransfer {
    std::shared_ptr<Transfer> t;
    std::string kind;
};

// --- the agent -----------------------------------------------------------------------------------

class PyAgent {
  public:
    PyAgent(std::string name, std::vector<std::string> backends, std::string listen,
            std::optional<std::string> secret, std::optional<std::string> store, double timeout) {
        AgentConfig c;
        c.name = std::move(name);
        c.backends = std::move(backends);
        auto hp = ParseHostPort(listen, 0);
        if (!hp.ok()) {
            throw py::value_error("listen must be 'host:port' (port 0: any free port): " +
                                  hp.status().message());
        }
        c.listen_host = hp->host;
        c.listen_port = hp->port;
        if (secret) c.secret = *secret;
        if (store) c.store = *store;
        c.default_timeout = Millis(timeout, 30);
        std::unique_ptr<Agent> a;
        {
            py::gil_scoped_release release;
            auto r = Agent::Create(std::move(c));
            if (!r.ok()) {
                py::gil_scoped_acquire acquire;
                Raise(r.status());
            }
            a = std::move(r).value();
        }
        agent_ = std::move(a);
    }

    ~PyAgent() { Close(); }
    PyAgent(const PyAgent&) = delete;
    PyAgent& operator=(const PyAgent&) = delete;

    Agent& agent() {
        if (!agent_) Raise(FailedPreconditionError("the agent is closed"));
        return *agent_;
    }

    void Close() {
        if (!agent_) return;
        std::unique_ptr<Agent> a = std::move(agent_);
        {
            py::gil_scoped_release release;
            a.reset();
        }
        for (auto& [id, r] : regions_) {
            r->registered = false;
            r->view.reset();
            r->owner = py::none();
        }
        regions_.clear();
    }

    std::shared_ptr<Region> RegisterMemory(py::object obj) {
        auto region = std::make_shared<Region>();
        void* ptr = nullptr;
        size_t len = 0;
        if (py::isinstance<py::tuple>(obj) && py::len(obj) == 2) {
            auto t = obj.cast<py::tuple>();
            ptr = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
            len = t[1].cast<size_t>();
        } else if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size") &&
                   py::hasattr(obj, "numel")) {
            // A torch tensor: CPU and contiguous only (documented).
            if (!obj.attr("is_contiguous")().cast<bool>()) {
                throw py::value_error("register_memory: the tensor is not contiguous");
            }
            std::string device = py::str(obj.attr("device").attr("type"));
            if (device != "cpu") {
                throw py::value_error("register_memory: the tensor is on '" + device +
                                      "'; only CPU tensors are supported");
            }
            ptr = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
            len = obj.attr("numel")().cast<size_t>() * obj.attr("element_size")().cast<size_t>();
            region->owner = obj;
        } else if (PyObject_CheckBuffer(obj.ptr())) {
            auto* view = new Py_buffer();
            if (PyObject_GetBuffer(obj.ptr(), view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
                delete view;
                PyErr_Clear();
                throw py::value_error(
                    "register_memory: the buffer is read-only or not contiguous (a peer may "
                    "write into registered memory; use a bytearray, a writable numpy array or "
                    "an mmap)");
            }
            region->view.reset(view);
            ptr = view->buf;
            len = static_cast<size_t>(view->len);
            region->owner = obj;
        } else {
            throw py::type_error(
                "register_memory takes a writable buffer (bytearray, numpy array, mmap), a CPU "
                "torch tensor, or a (ptr, length) tuple");
        }
        if (len == 0) throw py::value_error("register_memory: the memory is empty");
        RegionInfo info;
        {
            py::gil_scoped_release release;
            auto r = agent().RegisterMemory(ptr, len);
            if (!r.ok()) {
                py::gil_scoped_acquire acquire;
                Raise(r.status());
            }
            info = *r;
        }
        region->info = info;
        regions_[info.id] = region;
        return region;
    }

    std::shared_ptr<Region> Allocate(size_t length) {
        RegionInfo info;
        {
            py::gil_scoped_release release;
            auto r = agent().AllocateRegion(length);
            if (!r.ok()) {
                py::gil_scoped_acquire acquire;
                Raise(r.status());
            }
            info = *r;
        }
        auto region = std::make_shared<Region>();
        region->info = info;
        region->allocated = true;
        regions_[info.id] = region;
        return region;
    }

    void Deregister(py::object which) {
        const RegionId id = RegionIdOf(which);
        Status st;
        {
            py::gil_scoped_release release;
            st = agent().Deregister(id);
        }
        Check(st);
        auto it = regions_.find(id);
        if (it != regions_.end()) {
            it->second->registered = false;
            it->second->view.reset();
            it->second->owner = py::none();
            regions_.erase(it);
        }
    }

    std::vector<std::shared_ptr<Region>> Regions() const {
        std::vector<std::shared_ptr<Region>> out;
        for (const auto& [id, r] : regions_) out.push_back(r);
        return out;
    }

    std::unique_ptr<Agent> agent_;
    std::map<RegionId, std::shared_ptr<Region>> regions_;
};

// A list of descriptors from Descriptor objects or (region, offset, length) tuples; one of them
// alone stands for a list of one.
std::vector<Descriptor> Descriptors(const py::object& obj, const char* what) {
    std::vector<Descriptor> out;
    auto one = [&](const py::handle& h) {
        if (py::isinstance<Descriptor>(h)) {
            out.push_back(h.cast<Descriptor>());
            return;
        }
        if (py::isinstance<py::tuple>(h) || py::isinstance<py::list>(h)) {
            auto s = h.cast<py::sequence>();
            if (s.size() == 3) {
                Descriptor d;
                d.region = RegionIdOf(s[0]);
                d.offset = s[1].cast<uint64_t>();
                d.length = s[2].cast<uint64_t>();
                out.push_back(d);
                return;
            }
        }
        throw py::type_error(std::string(what) +
                             ": each descriptor is a ferry.Descriptor or a (region, offset, "
                             "length) tuple");
    };
    if (py::isinstance<Descriptor>(obj) || (py::isinstance<py::tuple>(obj) && py::len(obj) == 3 &&
                                            !py::isinstance<py::tuple>(obj.cast<py::tuple>()[0]))) {
        one(obj);
        return out;
    }
    for (const py::handle& h : obj) one(h);
    return out;
}

PyTransfer Post(PyAgent& self, bool read, const py::object& local, const std::string& peer,
                const py::object& remote, std::optional<py::bytes> notification,
                std::optional<double> timeout, std::string backend) {
    std::vector<Descriptor> l = Descriptors(local, "local"), r = Descriptors(remote, "remote");
    TransferOptions o;
    if (notification) o.notification = std::string(*notification);
    if (timeout) o.timeout = Millis(timeout, 0);
    o.backend = std::move(backend);
    Agent& a = self.agent();
    Result<Transfer> t = InternalError("unset");
    {
        py::gil_scoped_release release;
        t = read ? a.PostRead(l, peer, r, o) : a.PostWrite(l, peer, r, o);
    }
    return PyTransfer{std::make_shared<Transfer>(Take(std::move(t))), read ? "read" : "write"};
}

py::list NotificationList(std::vector<Notification> ns) {
    py::list out;
    for (Notification& n : ns) out.append(py::make_tuple(n.peer, py::bytes(n.payload)));
    return out;
}

}  // namespace
}  // namespace ferry::python

PYBIND11_MODULE(_native, m) {
    using namespace ferry;
    using namespace ferry::python;
    m.doc() = "ferry's transfer engine (native part; import ferry)";

    // Exceptions: ferry.Error, with .code (e.g. "NotFound") and .message, and a subclass per
    // code: ferry.NotFound, ferry.Unavailable, ...
    base_error = PyErr_NewException("ferry.Error", PyExc_Exception, nullptr);
    m.attr("Error") = py::handle(base_error);
    for (int c = 1; c <= 15; ++c) {
        const auto code = static_cast<Code>(c);
        const std::string name(CodeName(code));
        PyObject* cls = PyErr_NewException(("ferry." + name).c_str(), base_error, nullptr);
        ErrorClasses()[code] = cls;
        m.attr(name.c_str()) = py::handle(cls);
    }

    py::class_<Descriptor>(m, "Descriptor",
                           "count runs of length bytes, stride bytes apart, from offset in "
                           "region (count 1: one contiguous run)")
        .def(py::init([](py::object region, uint64_t offset, uint64_t length, uint64_t stride,
                         uint64_t count) {
                 Descriptor d;
                 d.region = RegionIdOf(region);
                 d.offset = offset;
                 d.length = length;
                 d.stride = stride;
                 d.count = count;
                 return d;
             }),
             py::arg("region"), py::arg("offset"), py::arg("length"), py::arg("stride") = 0,
             py::arg("count") = 1)
        .def_readwrite("region", &Descriptor::region)
        .def_readwrite("offset", &Descriptor::offset)
        .def_readwrite("length", &Descriptor::length)
        .def_readwrite("stride", &Descriptor::stride)
        .def_readwrite("count", &Descriptor::count)
        .def_property_readonly("total_bytes", &Descriptor::TotalBytes)
        .def("__repr__", [](const Descriptor& d) {
            return "Descriptor(region=" + std::to_string(d.region) +
                   ", offset=" + std::to_string(d.offset) + ", length=" + std::to_string(d.length) +
                   (d.count > 1 ? ", stride=" + std::to_string(d.stride) +
                                      ", count=" + std::to_string(d.count)
                                : std::string()) +
                   ")";
        });

    py::class_<Region, std::shared_ptr<Region>>(m, "Region", "a registered memory region")
        .def_property_readonly("id", [](const Region& r) { return r.info.id; })
        .def_property_readonly(
            "ptr", [](const Region& r) { return reinterpret_cast<uintptr_t>(r.info.base); })
        .def_property_readonly("length", [](const Region& r) { return r.info.length; })
        .def_property_readonly("key", [](const Region& r) { return r.info.key; })
        .def_property_readonly("registered", [](const Region& r) { return r.registered; })
        .def_property_readonly("owner", [](const Region& r) { return r.owner; })
        .def_property_readonly(
            "buffer",
            [](py::object self) -> py::object {
                auto& r = self.cast<Region&>();
                if (!r.registered) Raise(FailedPreconditionError("the region is deregistered"));
                // A writable memoryview of the region's memory; valid while it is registered.
                return py::memoryview::from_memory(r.info.base, static_cast<ssize_t>(r.info.length),
                                                   false);
            },
            "a writable memoryview of the region's bytes (valid while registered)")
        .def("__len__", [](const Region& r) { return r.info.length; })
        .def("__int__", [](const Region& r) { return r.info.id; })
        .def("__index__", [](const Region& r) { return r.info.id; })
        .def("__repr__", [](const Region& r) {
            return "Region(id=" + std::to_string(r.info.id) +
                   ", length=" + std::to_string(r.info.length) +
                   (r.registered ? "" : ", deregistered") + ")";
        });

    py::class_<PyTransfer>(m, "Transfer", "a posted READ or WRITE")
        .def(
            "poll",
            [](PyTransfer& t) -> std::string {
                auto s = t.t->Poll();
                if (!s.ok()) Raise(s.status());
                return *s == TransferState::kDone ? "done" : "pending";
            },
            "'pending' or 'done'; raises the error the transfer failed with")
        .def(
            "wait",
            [](PyTransfer& t, std::optional<double> timeout) {
                Status st;
                {
                    py::gil_scoped_release release;
                    st = timeout ? t.t->Wait(Millis(timeout, 0))
                                 : t.t->Wait(Clock::time_point::max());
                }
                Check(st);
            },
            py::arg("timeout") = py::none(),
            "blocks until done (or raises: the transfer's error, DeadlineExceeded past timeout)")
        .def("cancel",
             [](PyTransfer& t) {
                 Status st;
                 {
                     py::gil_scoped_release release;
                     st = t.t->Cancel();
                 }
                 Check(st);
             })
        .def_property_readonly("bytes", [](const PyTransfer& t) { return t.t->bytes(); })
        .def_property_readonly("kind", [](const PyTransfer& t) { return t.kind; })
        .def("__await__", [](py::object self) {
            return py::module_::import("ferry._aio").attr("wait")(self).attr("__await__")();
        });

    py::class_<PyAgent>(m, "Agent", "a transfer agent: registers memory, moves bytes to peers")
        .def(py::init<std::string, std::vector<std::string>, std::string,
                      std::optional<std::string>, std::optional<std::string>, double>(),
             py::arg("name"), py::arg("backends") = std::vector<std::string>{"shm", "tcp"},
             py::arg("listen") = "127.0.0.1:0", py::arg("secret") = py::none(),
             py::arg("store") = py::none(), py::arg("timeout") = 30.0)
        .def_property_readonly("name", [](PyAgent& a) { return a.agent().name(); })
        .def_property_readonly("epoch", [](PyAgent& a) { return a.agent().epoch(); })
        .def_property_readonly("listen_address",
                               [](PyAgent& a) { return a.agent().ListenAddress(); })
        .def("close", &PyAgent::Close, "stops the agent: pending transfers fail with Cancelled")
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](PyAgent& a, py::args) { a.Close(); })
        .def("register_memory", &PyAgent::RegisterMemory, py::arg("memory"))
        .def("allocate", &PyAgent::Allocate, py::arg("length"))
        .def("deregister", &PyAgent::Deregister, py::arg("region"))
        .def("regions", &PyAgent::Regions)
        .def("metadata", [](PyAgent& a) { return py::bytes(a.agent().Metadata()); })
        .def(
            "add_peer",
            [](PyAgent& a, py::bytes md) {
                std::string s = md;
                Result<std::string> r = InternalError("unset");
                {
                    py::gil_scoped_release release;
                    r = a.agent().AddPeer(s);
                }
                return Take(std::move(r));
            },
            py::arg("metadata"))
        .def(
            "connect",
            [](PyAgent& a, const std::string& host_port, double timeout) {
                Result<std::string> r = InternalError("unset");
                auto ms = Millis(timeout, 5);
                {
                    py::gil_scoped_release release;
                    r = a.agent().Connect(host_port, ms);
                }
                return Take(std::move(r));
            },
            py::arg("host_port"), py::arg("timeout") = 5.0)
        .def(
            "connect_by_name",
            [](PyAgent& a, const std::string& name) {
                Result<std::string> r = InternalError("unset");
                {
                    py::gil_scoped_release release;
                    r = a.agent().ConnectByName(name);
                }
                return Take(std::move(r));
            },
            py::arg("name"))
        .def("remove_peer",
             [](PyAgent& a, const std::string& name) {
                 Status st;
                 {
                     py::gil_scoped_release release;
                     st = a.agent().RemovePeer(name);
                 }
                 Check(st);
             })
        .def("peer_backend",
             [](PyAgent& a, const std::string& name) { return Take(a.agent().PeerBackend(name)); })
        .def(
            "read",
            [](PyAgent& a, py::object local, const std::string& peer, py::object remote,
               std::optional<py::bytes> notification, std::optional<double> timeout,
               std::string backend) {
                return Post(a, true, local, peer, remote, notification, timeout, backend);
            },
            py::arg("local"), py::arg("peer"), py::arg("remote"),
            py::arg("notification") = py::none(), py::arg("timeout") = py::none(),
            py::arg("backend") = "", "READ remote -> local; returns a Transfer")
        .def(
            "write",
            [](PyAgent& a, py::object local, const std::string& peer, py::object remote,
               std::optional<py::bytes> notification, std::optional<double> timeout,
               std::string backend) {
                return Post(a, false, local, peer, remote, notification, timeout, backend);
            },
            py::arg("local"), py::arg("peer"), py::arg("remote"),
            py::arg("notification") = py::none(), py::arg("timeout") = py::none(),
            py::arg("backend") = "", "WRITE local -> remote; returns a Transfer")
        .def(
            "notify",
            [](PyAgent& a, const std::string& peer, py::bytes payload) {
                std::string p = payload;
                Status st;
                {
                    py::gil_scoped_release release;
                    st = a.agent().Notify(peer, p);
                }
                Check(st);
            },
            py::arg("peer"), py::arg("payload"))
        .def("take_notifications",
             [](PyAgent& a) { return NotificationList(a.agent().TakeNotifications()); })
        .def(
            "wait_notifications",
            [](PyAgent& a, double timeout) {
                std::vector<Notification> ns;
                auto ms = Millis(timeout, 0);
                {
                    py::gil_scoped_release release;
                    ns = a.agent().WaitNotifications(Clock::now() + ms);
                }
                return NotificationList(std::move(ns));
            },
            py::arg("timeout"))
        .def(
            "publish",
            [](PyAgent& a, const std::string& key, py::object descriptors) {
                Check(a.agent().Publish(key, Descriptors(descriptors, "descriptors")));
            },
            py::arg("key"), py::arg("descriptors"))
        .def("unpublish",
             [](PyAgent& a, const std::string& key) { Check(a.agent().Unpublish(key)); })
        .def(
            "pull_by_key",
            [](PyAgent& a, const std::string& peer, const std::string& key, py::object local,
               double timeout) {
                std::vector<Descriptor> l = Descriptors(local, "local");
                if (l.size() != 1) throw py::value_error("pull_by_key: one local descriptor");
                auto ms = Millis(timeout, 30);
                Result<PullResult> r = InternalError("unset");
                {
                    py::gil_scoped_release release;
                    r = a.agent().PullByKey(peer, key, l[0], ms);
                }
                PullResult p = Take(std::move(r));
                return py::make_tuple(p.object_size, p.copied);
            },
            py::arg("peer"), py::arg("key"), py::arg("local"), py::arg("timeout") = 30.0,
            "(object_size, copied): copied is False when local is too small")
        .def("stats", [](PyAgent& a) {
            AgentStats s = a.agent().Stats();
            py::dict d;
            d["transfers_posted"] = s.transfers_posted;
            d["one_sided_transfers"] = s.one_sided_transfers;
            d["bytes_posted"] = s.bytes_posted;
            d["handshakes_pending"] = s.handshakes_pending;
            d["handshakes_refused"] = s.handshakes_refused;
            d["stalled_frames_dropped"] = s.stalled_frames_dropped;
            d["receive_budget_used"] = s.receive_budget_used;
            d["receive_budget_waits"] = s.receive_budget_waits;
            d["messages_sent"] = s.messages_sent;
            d["messages_received"] = s.messages_received;
            return d;
        });
}
