#include "gguf/gguf.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/fd.h"

namespace ferry::gguf {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint32_t kVersion = 3;
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint64_t kMaxCount = 1u << 24;  // kv pairs, tensors, array elements

// The fewest bytes a value of `t` takes in the file.
uint64_t MinValueSize(GgufValueType t) {
    switch (t) {
        case GgufValueType::kUint8:
        case GgufValueType::kInt8:
        case GgufValueType::kBool:
            return 1;
        case GgufValueType::kUint16:
        case GgufValueType::kInt16:
            return 2;
        case GgufValueType::kUint32:
        case GgufValueType::kInt32:
        case GgufValueType::kFloat32:
            return 4;
        case GgufValueType::kString:  // its length
        case GgufValueType::kArray:   // type and count
        case GgufValueType::kUint64:
        case GgufValueType::kInt64:
        case GgufValueType::kFloat64:
            return 8;
    }
    return 1;
}
constexpr uint32_t kMaxDims = 4;

// Bounds-checked little-endian reader over the mapping.
class Reader {
  public:
    Reader(const uint8_t* p, size_t n, const std::string& path) : p_(p), n_(n), path_(path) {}

    template <typename T>
    bool Scalar(T* v, const char* what) {
        if (n_ - pos_ < sizeof(T)) return Fail(std::string("truncated ") + what);
        std::memcpy(v, p_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return true;
    }
    bool String(std::string* s, const char* what) {
        uint64_t len = 0;
        if (!Scalar(&len, what)) return false;
        if (len > n_ - pos_)
            return Fail(std::string(what) + " of " + std::to_string(len) +
                        " bytes runs past the end of the file");
        s->assign(reinterpret_cast<const char*>(p_ + pos_), len);
        pos_ += len;
        return true;
    }
    bool Fail(std::string why) {
        if (error_.ok()) {
            error_ =
                InvalidArgumentError(path_ + ": GGUF at byte " + std::to_string(pos_) + ": " + why);
        }
        return false;
    }
    size_t pos() const { return pos_; }
    size_t size() const { return n_; }
    const Status& error() const { return error_; }

  private:
    const uint8_t* p_;
    size_t n_;
    size_t pos_ = 0;
    const std::string& path_;
    Status error_;
};

bool ReadValue(Reader& r, GgufValueType type, GgufValue* out, bool in_array) {
    out->type = type;
    switch (type) {
        case GgufValueType::kUint8: {
            uint8_t v = 0;
            if (!r.Scalar(&v, "u8")) return false;
            out->scalar = uint64_t{v};
            return true;
        }
        case GgufValueType::kInt8: {
            int8_t v = 0;
            if (!r.Scalar(&v, "i8")) return false;
            out->scalar = int64_t{v};
            return true;
        }
        case GgufValueType::kUint16: {
            uint16_t v = 0;
            if (!r.Scalar(&v, "u16")) return false;
            out->scalar = uint64_t{v};
            return true;
        }
        case GgufValueType::kInt16: {
            int16_t v = 0;
            if (!r.Scalar(&v, "i16")) return false;
            out->scalar = int64_t{v};
            return true;
        }
        case GgufValueType::kUint32: {
            uint32_t v = 0;
            if (!r.Scalar(&v, "u32")) return false;
            out->scalar = uint64_t{v};
            return true;
        }
        case GgufValueType::kInt32: {
            int32_t v = 0;
            if (!r.Scalar(&v, "i32")) return false;
            out->scalar = int64_t{v};
            return true;
        }
        case GgufValueType::kUint64: {
            uint64_t v = 0;
            if (!r.Scalar(&v, "u64")) return false;
            out->scalar = v;
            return true;
        }
        case GgufValueType::kInt64: {
            int64_t v = 0;
            if (!r.Scalar(&v, "i64")) return false;
            out->scalar = v;
            return true;
        }
        case GgufValueType::kFloat32: {
            float v = 0;
            if (!r.Scalar(&v, "f32")) return false;
            out->scalar = double{v};
            return true;
        }
        case GgufValueType::kFloat64: {
            double v = 0;
            if (!r.Scalar(&v, "f64")) return false;
            out->scalar = v;
            return true;
        }
        case GgufValueType::kBool: {
            uint8_t v = 0;
            if (!r.Scalar(&v, "bool")) return false;
            if (v > 1) return r.Fail("bool value " + std::to_string(v));
            out->scalar = v == 1;
            return true;
        }
        case GgufValueType::kString: {
            std::string s;
            if (!r.String(&s, "string")) return false;
            out->scalar = std::move(s);
            return true;
        }
        case GgufValueType::kArray: {
            if (in_array) return r.Fail("arrays of arrays are not supported");
            uint32_t et = 0;
            uint64_t count = 0;
            if (!r.Scalar(&et, "array type") || !r.Scalar(&count, "array length")) return false;
            if (et > static_cast<uint32_t>(GgufValueType::kFloat64)) {
                return r.Fail("unknown array element type " + std::to_string(et));
            }
            // Every element takes at least its smallest encoding (a string its 8-byte length):
            // a count beyond the rest of the file lies, and is refused before anything is
            // allocated for it.
            const uint64_t min_size = MinValueSize(static_cast<GgufValueType>(et));
            if (count > kMaxCount || count > (r.size() - r.pos()) / min_size) {
                return r.Fail("array of " + std::to_string(count) + " elements is too long");
            }
            out->element_type = static_cast<GgufValueType>(et);
            out->array.resize(count);
            for (GgufValue& v : out->array) {
                if (!ReadValue(r, out->element_type, &v, true)) return false;
            }
            return true;
        }
    }
    return r.Fail("unknown value type " + std::to_string(static_cast<uint32_t>(type)));
}

}  // namespace

size_t TensorTypeSize(TensorType t) {
    switch (t) {
        case TensorType::kF32:
            return 4;
        case TensorType::kF16:
            return 2;
        case TensorType::kBF16:
            return 2;
    }
    return 0;
}

std::string_view TensorTypeName(TensorType t) {
    switch (t) {
        case TensorType::kF32:
            return "F32";
        case TensorType::kF16:
            return "F16";
        case TensorType::kBF16:
            return "BF16";
    }
    return "unknown";
}

uint64_t GgufTensor::elements() const {
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    return n;
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
    ScopedFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
        return NotFoundError(path + ": cannot open: " + std::strerror(errno));
    }
    struct stat st {};
    if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return InvalidArgumentError(path + ": not a regular file");
    }
    auto f = std::unique_ptr<GgufFile>(new GgufFile());
    f->path_ = path;
    f->size_ = static_cast<size_t>(st.st_size);
    if (f->size_ < 24) {
        return InvalidArgumentError(path + ": " + std::to_string(f->size_) +
                                    " bytes is too short for a GGUF header");
    }
    void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) {
        return InvalidArgumentError(path + ": mmap: " + std::strerror(errno));
    }
    f->base_ = static_cast<const uint8_t*>(p);
    FERRY_RETURN_IF_ERROR(f->Parse());
    return f;
}

GgufFile::~GgufFile() {
    if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), size_);
}

Status GgufFile::Parse() {
    Reader r(base_, size_, path_);
    uint32_t magic = 0;
    uint64_t n_tensors = 0, n_kv = 0;
    r.Scalar(&magic, "magic");
    if (magic != kMagic) {
        return InvalidArgumentError(path_ + ": not a GGUF file (bad magic)");
    }
    r.Scalar(&version_, "version");
    if (version_ != kVersion) {
        return InvalidArgumentError(path_ + ": GGUF version " + std::to_string(version_) +
                                    " is not supported (only 3)");
    }
    if (!r.Scalar(&n_tensors, "tensor count") || !r.Scalar(&n_kv, "kv count")) return r.error();
    if (n_tensors > kMaxCount || n_kv > kMaxCount) {
        return InvalidArgumentError(path_ + ": implausible counts (" + std::to_string(n_tensors) +
                                    " tensors, " + std::to_string(n_kv) + " keys)");
    }
    for (uint64_t i = 0; i < n_kv; ++i) {
        std::string key;
        uint32_t type = 0;
        if (!r.String(&key, "key") || !r.Scalar(&type, "value type")) return r.error();
        if (type > static_cast<uint32_t>(GgufValueType::kFloat64)) {
            r.Fail("key '" + key + "': unknown value type " + std::to_string(type));
            return r.error();
        }
        GgufValue v;
        if (!ReadValue(r, static_cast<GgufValueType>(type), &v, false)) return r.error();
        if (!metadata_.emplace(key, std::move(v)).second) {
            r.Fail("duplicate key '" + key + "'");
            return r.error();
        }
    }
    if (const GgufValue* a = Find("general.alignment")) {
        const uint64_t* v = std::get_if<uint64_t>(&a->scalar);
        if (a->type != GgufValueType::kUint32 || !v || *v == 0 || (*v & (*v - 1)) != 0 ||
            *v > 65536) {
            return InvalidArgumentError(path_ + ": general.alignment must be a power of two u32");
        }
        alignment_ = *v;
    }
    // A tensor's description takes at least 32 bytes (name length, one dimension, type,
    // offset): more tensors than the rest of the file can describe is a lie, refused before the
    // table is allocated (a 200-byte file could otherwise ask for millions of entries).
    if (n_tensors > (r.size() - r.pos()) / 32) {
        return InvalidArgumentError(path_ + ": " + std::to_string(n_tensors) +
                                    " tensors cannot be described in the " +
                                    std::to_string(r.size() - r.pos()) + " bytes left");
    }
    tensors_.resize(n_tensors);
    for (GgufTensor& t : tensors_) {
        uint32_t n_dims = 0, type = 0;
        if (!r.String(&t.name, "tensor name") || !r.Scalar(&n_dims, "tensor dims")) {
            return r.error();
        }
        if (n_dims == 0 || n_dims > kMaxDims) {
            r.Fail("tensor '" + t.name + "': " + std::to_string(n_dims) + " dimensions");
            return r.error();
        }
        t.dims.resize(n_dims);
        uint64_t elements = 1;
        for (uint64_t& d : t.dims) {
            if (!r.Scalar(&d, "tensor dim")) return r.error();
            if (d == 0 || d > (uint64_t{1} << 40) ||
                elements > std::numeric_limits<uint64_t>::max() / d) {
                r.Fail("tensor '" + t.name + "': bad dimension " + std::to_string(d));
                return r.error();
            }
            elements *= d;
        }
        if (!r.Scalar(&type, "tensor type") || !r.Scalar(&t.offset, "tensor offset")) {
            return r.error();
        }
        if (type != 0 && type != 1 && type != 30) {
            r.Fail("tensor '" + t.name + "': ggml type " + std::to_string(type) +
                   " is not supported (F32, F16, BF16 only; quantized files need converting)");
            return r.error();
        }
        t.type = static_cast<TensorType>(type);
        if (elements > std::numeric_limits<uint64_t>::max() / 4) {
            r.Fail("tensor '" + t.name + "' is too large");
            return r.error();
        }
        t.bytes = elements * TensorTypeSize(t.type);
        if (t.offset % alignment_ != 0) {
            r.Fail("tensor '" + t.name + "': offset " + std::to_string(t.offset) +
                   " is not aligned to " + std::to_string(alignment_));
            return r.error();
        }
    }
    uint64_t data_start = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
    for (GgufTensor& t : tensors_) {
        if (data_start > size_ || t.offset > size_ - data_start ||
            t.bytes > size_ - data_start - t.offset) {
            return InvalidArgumentError(path_ + ": tensor '" + t.name + "' (" +
                                        std::to_string(t.bytes) + " bytes at data offset " +
                                        std::to_string(t.offset) +
                                        ") runs past the end of the file");
        }
        t.data = base_ + data_start + t.offset;
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
        for (size_t j = i + 1; j < tensors_.size(); ++j) {
            if (tensors_[i].name == tensors_[j].name) {
                return InvalidArgumentError(path_ + ": duplicate tensor '" + tensors_[i].name +
                                            "'");
            }
        }
    }
    return Status::Ok();
}

const GgufValue* GgufFile::Find(std::string_view key) const {
    auto it = metadata_.find(key);
    return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
    for (const GgufTensor& t : tensors_) {
        if (t.name == name) return &t;
    }
    return nullptr;
}

Result<std::string> GgufFile::GetString(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (!v) return NotFoundError(path_ + ": no metadata key '" + std::string(key) + "'");
    if (const auto* s = std::get_if<std::string>(&v->scalar);
        s && v->type == GgufValueType::kString) {
        return *s;
    }
    return InvalidArgumentError(path_ + ": '" + std::string(key) + "' is not a string");
}

Result<uint64_t> GgufFile::GetUint(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (!v) return NotFoundError(path_ + ": no metadata key '" + std::string(key) + "'");
    if (v->type != GgufValueType::kArray) {
        if (const auto* u = std::get_if<uint64_t>(&v->scalar)) return *u;
        if (const auto* i = std::get_if<int64_t>(&v->scalar); i && *i >= 0) {
            return static_cast<uint64_t>(*i);
        }
    }
    return InvalidArgumentError(path_ + ": '" + std::string(key) +
                                "' is not a non-negative integer");
}

Result<double> GgufFile::GetFloat(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (!v) return NotFoundError(path_ + ": no metadata key '" + std::string(key) + "'");
    if (const auto* d = std::get_if<double>(&v->scalar); d && v->type != GgufValueType::kArray) {
        return *d;
    }
    return InvalidArgumentError(path_ + ": '" + std::string(key) + "' is not a float");
}

std::string GgufFile::TensorSample() const {
    std::string id;
    for (const GgufTensor& t : tensors_) {
        id +=
            fmt::format("|{}:{}:{}:{}:", t.name, static_cast<uint32_t>(t.type), t.offset, t.bytes);
        for (uint64_t d : t.dims) id += fmt::format("{},", d);
        size_t n = std::min<uint64_t>(t.bytes, 64);
        id.append(reinterpret_cast<const char*>(t.data), n);
        id.append(reinterpret_cast<const char*>(t.data + t.bytes - n), n);
    }
    return id;
}

Result<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
    const GgufValue* v = Find(key);
    if (!v) return NotFoundError(path_ + ": no metadata key '" + std::string(key) + "'");
    if (v->type != GgufValueType::kArray || v->element_type != GgufValueType::kString) {
        return InvalidArgumentError(path_ + ": '" + std::string(key) + "' is not a string array");
    }
    std::vector<std::string> out;
    out.reserve(v->array.size());
    for (const GgufValue& e : v->array) out.push_back(std::get<std::string>(e.scalar));
    return out;
}

// --- Writer -----------------------------------------------------------------------------------

namespace {

template <typename T>
void Put(std::string* out, T v) {
    out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void PutString(std::string* out, std::string_view s) {
    Put<uint64_t>(out, s.size());
    out->append(s);
}

}  // namespace

void GgufWriter::Set(std::string key, std::string encoded) {
    for (Entry& e : entries_) {
        if (e.key == key) {
            e.encoded = std::move(encoded);
            return;
        }
    }
    entries_.push_back(Entry{std::move(key), std::move(encoded)});
}

void GgufWriter::SetString(std::string key, std::string value) {
    std::string e;
    Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::kString));
    PutString(&e, value);
    Set(std::move(key), std::move(e));
}

#define FERRY_GGUF_SCALAR(Name, T, Type)                               \
    void GgufWriter::Name(std::string key, T value) {                  \
        std::string e;                                                 \
        Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::Type)); \
        Put<T>(&e, value);                                             \
        Set(std::move(key), std::move(e));                             \
    }
FERRY_GGUF_SCALAR(SetUint32, uint32_t, kUint32)
FERRY_GGUF_SCALAR(SetUint64, uint64_t, kUint64)
FERRY_GGUF_SCALAR(SetInt32, int32_t, kInt32)
FERRY_GGUF_SCALAR(SetFloat32, float, kFloat32)
FERRY_GGUF_SCALAR(SetFloat64, double, kFloat64)
#undef FERRY_GGUF_SCALAR

void GgufWriter::SetBool(std::string key, bool value) {
    std::string e;
    Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::kBool));
    Put<uint8_t>(&e, value ? 1 : 0);
    Set(std::move(key), std::move(e));
}

void GgufWriter::SetStringArray(std::string key, std::vector<std::string> values) {
    std::string e;
    Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::kArray));
    Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::kString));
    Put<uint64_t>(&e, values.size());
    for (const std::string& s : values) PutString(&e, s);
    Set(std::move(key), std::move(e));
}

#define FERRY_GGUF_ARRAY(Name, T, Type)                                  \
    void GgufWriter::Name(std::string key, std::vector<T> values) {      \
        std::string e;                                                   \
        Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::kArray)); \
        Put<uint32_t>(&e, static_cast<uint32_t>(GgufValueType::Type));   \
        Put<uint64_t>(&e, values.size());                                \
        for (T v : values) Put<T>(&e, v);                                \
        Set(std::move(key), std::move(e));                               \
    }
FERRY_GGUF_ARRAY(SetInt32Array, int32_t, kInt32)
FERRY_GGUF_ARRAY(SetFloat32Array, float, kFloat32)
FERRY_GGUF_ARRAY(SetFloat64Array, double, kFloat64)
#undef FERRY_GGUF_ARRAY

namespace {

// One value's bytes in `type` (no type tag): the scalar GgufFile widened, narrowed back.
Status PutValue(std::string* e, GgufValueType type, const GgufValue& v) {
    auto u = std::get_if<uint64_t>(&v.scalar);
    auto i = std::get_if<int64_t>(&v.scalar);
    auto d = std::get_if<double>(&v.scalar);
    auto bad = [&] {
        return InvalidArgumentError(fmt::format("GGUF value of type {} holds another kind of value",
                                                static_cast<uint32_t>(type)));
    };
    switch (type) {
        case GgufValueType::kUint8:
            if (!u) return bad();
            Put<uint8_t>(e, static_cast<uint8_t>(*u));
            return Status::Ok();
        case GgufValueType::kUint16:
            if (!u) return bad();
            Put<uint16_t>(e, static_cast<uint16_t>(*u));
            return Status::Ok();
        case GgufValueType::kUint32:
            if (!u) return bad();
            Put<uint32_t>(e, static_cast<uint32_t>(*u));
            return Status::Ok();
        case GgufValueType::kUint64:
            if (!u) return bad();
            Put<uint64_t>(e, *u);
            return Status::Ok();
        case GgufValueType::kInt8:
            if (!i) return bad();
            Put<int8_t>(e, static_cast<int8_t>(*i));
            return Status::Ok();
        case GgufValueType::kInt16:
            if (!i) return bad();
            Put<int16_t>(e, static_cast<int16_t>(*i));
            return Status::Ok();
        case GgufValueType::kInt32:
            if (!i) return bad();
            Put<int32_t>(e, static_cast<int32_t>(*i));
            return Status::Ok();
        case GgufValueType::kInt64:
            if (!i) return bad();
            Put<int64_t>(e, *i);
            return Status::Ok();
        case GgufValueType::kFloat32:
            if (!d) return bad();
            Put<float>(e, static_cast<float>(*d));
            return Status::Ok();
        case GgufValueType::kFloat64:
            if (!d) return bad();
            Put<double>(e, *d);
            return Status::Ok();
        case GgufValueType::kBool: {
            auto b = std::get_if<bool>(&v.scalar);
            if (!b) return bad();
            Put<uint8_t>(e, *b ? 1 : 0);
            return Status::Ok();
        }
        case GgufValueType::kString: {
            auto s = std::get_if<std::string>(&v.scalar);
            if (!s) return bad();
            PutString(e, *s);
            return Status::Ok();
        }
        case GgufValueType::kArray:
            break;
    }
    return bad();
}

}  // namespace

Status GgufWriter::SetValue(std::string key, const GgufValue& value) {
    std::string e;
    Put<uint32_t>(&e, static_cast<uint32_t>(value.type));
    if (value.type == GgufValueType::kArray) {
        Put<uint32_t>(&e, static_cast<uint32_t>(value.element_type));
        Put<uint64_t>(&e, value.array.size());
        for (const GgufValue& v : value.array) {
            FERRY_RETURN_IF_ERROR(PutValue(&e, value.element_type, v));
        }
    } else {
        FERRY_RETURN_IF_ERROR(PutValue(&e, value.type, value));
    }
    Set(std::move(key), std::move(e));
    return Status::Ok();
}

Status GgufWriter::AddTensor(std::string name, std::vector<uint64_t> dims, TensorType type,
                             std::string data) {
    if (dims.empty() || dims.size() > kMaxDims) {
        return InvalidArgumentError("tensor '" + name + "': 1.." + std::to_string(kMaxDims) +
                                    " dimensions");
    }
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    if (n * TensorTypeSize(type) != data.size()) {
        return InvalidArgumentError("tensor '" + name + "': " + std::to_string(data.size()) +
                                    " bytes for " + std::to_string(n) + " " +
                                    std::string(TensorTypeName(type)) + " elements");
    }
    for (const Tensor& t : tensors_) {
        if (t.name == name) return AlreadyExistsError("tensor '" + name + "' added twice");
    }
    tensors_.push_back(Tensor{std::move(name), std::move(dims), type, std::move(data)});
    return Status::Ok();
}

Status GgufWriter::Write(const std::string& path) const {
    std::string head;
    Put<uint32_t>(&head, kMagic);
    Put<uint32_t>(&head, kVersion);
    Put<uint64_t>(&head, tensors_.size());
    Put<uint64_t>(&head, entries_.size());
    for (const Entry& e : entries_) {
        PutString(&head, e.key);
        head += e.encoded;
    }
    uint64_t offset = 0;
    for (const Tensor& t : tensors_) {
        PutString(&head, t.name);
        Put<uint32_t>(&head, static_cast<uint32_t>(t.dims.size()));
        for (uint64_t d : t.dims) Put<uint64_t>(&head, d);
        Put<uint32_t>(&head, static_cast<uint32_t>(t.type));
        Put<uint64_t>(&head, offset);
        offset += (t.data.size() + kDefaultAlignment - 1) / kDefaultAlignment * kDefaultAlignment;
    }
    std::string tmp = path + ".tmp";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        if (!out) return UnavailableError(tmp + ": cannot create");
        out.write(head.data(), static_cast<std::streamsize>(head.size()));
        std::string pad((kDefaultAlignment - head.size() % kDefaultAlignment) % kDefaultAlignment,
                        '\0');
        out.write(pad.data(), static_cast<std::streamsize>(pad.size()));
        for (const Tensor& t : tensors_) {
            out.write(t.data.data(), static_cast<std::streamsize>(t.data.size()));
            std::string tpad(
                (kDefaultAlignment - t.data.size() % kDefaultAlignment) % kDefaultAlignment, '\0');
            out.write(tpad.data(), static_cast<std::streamsize>(tpad.size()));
        }
        if (!out.flush()) return UnavailableError(tmp + ": write failed");
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        return UnavailableError(path + ": rename: " + std::strerror(errno));
    }
    return Status::Ok();
}

}  // namespace ferry::gguf
