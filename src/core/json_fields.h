// Typed reads of a JSON object's fields from outside input (a peer's message, a request body):
// each read is a Result whose error names the field by its path and says what was wrong, in one
// style everywhere ("field 'compat.layers' is missing", "... must be an integer, not a string",
// "... = 9 is outside 1..8"). Fields nobody reads are ignored: a newer sender may add some.
//
// Header-only over nlohmann::json: a target that includes it links nlohmann_json itself.
#pragma once

#include <fmt/core.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry {

// JSON text for the wire: invalid UTF-8 (a client's bytes echoed in a message) is replaced, not
// thrown on.
inline std::string DumpJson(const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

class JsonFields {
  public:
    using Json = nlohmann::json;

    // `path` prefixes field names in errors ("compat" gives "compat.layers").
    explicit JsonFields(const Json& object, std::string path = "")
        : j_(&object), path_(std::move(path)) {}

    // What a JSON value is, in words ("a string", "null", ...).
    static const char* KindOf(const Json& v) {
        switch (v.type()) {
            case Json::value_t::null:
                return "null";
            case Json::value_t::object:
                return "an object";
            case Json::value_t::array:
                return "an array";
            case Json::value_t::string:
                return "a string";
            case Json::value_t::boolean:
                return "a boolean";
            case Json::value_t::number_integer:
            case Json::value_t::number_unsigned:
                return "an integer";
            case Json::value_t::number_float:
                return "a number";
            default:
                return "not a JSON value";
        }
    }

    // A JSON integer as int64_t; one beyond its range (only an unsigned one can be) becomes
    // INT64_MAX, so a range check that follows refuses it instead of seeing it wrap.
    static int64_t ClampedInt(const Json& v) {
        return v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX
                                                                                 : v.get<int64_t>();
    }

    std::string Name(std::string_view key) const {
        return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
    }

    bool Has(std::string_view key) const { return j_->is_object() && j_->contains(key); }

    // Optional fields, as OpenAI clients and vLLM's proxies send them: absent and null are both
    // "not given" (nullopt); a value of the wrong type or out of range is an error in this
    // class's words. A reader whose clients already match other words (an OpenAI request's,
    // kv_transfer_params') reads through these and words a failure its own way.
    const Json* Given(std::string_view key) const {
        if (!j_->is_object()) return nullptr;
        auto it = j_->find(key);
        return it == j_->end() || it->is_null() ? nullptr : &*it;
    }
    Result<std::optional<std::string>> OptString(std::string_view key,
                                                 size_t max_len = 4096) const {
        if (!Given(key)) return std::optional<std::string>();
        FERRY_ASSIGN_OR_RETURN(std::string v, String(key, max_len));
        return std::optional<std::string>(std::move(v));
    }
    Result<std::optional<int64_t>> OptInt(std::string_view key, int64_t lo, int64_t hi) const {
        if (!Given(key)) return std::optional<int64_t>();
        FERRY_ASSIGN_OR_RETURN(int64_t v, Int(key, lo, hi));
        return std::optional<int64_t>(v);
    }
    Result<std::optional<bool>> OptBool(std::string_view key) const {
        if (!Given(key)) return std::optional<bool>();
        FERRY_ASSIGN_OR_RETURN(bool v, Bool(key));
        return std::optional<bool>(v);
    }
    Result<std::optional<double>> OptNumber(std::string_view key) const {
        if (!Given(key)) return std::optional<double>();
        FERRY_ASSIGN_OR_RETURN(double v, Number(key));
        return std::optional<double>(v);
    }

    Result<std::string> String(std::string_view key, size_t max_len = 4096) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::string, "a string"));
        const std::string& s = v->get_ref<const std::string&>();
        if (s.size() > max_len) {
            return Bad(key, fmt::format("is longer than {} characters", max_len));
        }
        return s;
    }

    // Exactly `len` lowercase hex digits.
    Result<std::string> Hex(std::string_view key, size_t len) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::string, "a string"));
        const std::string& s = v->get_ref<const std::string&>();
        if (s.size() != len || s.find_first_not_of("0123456789abcdef") != std::string::npos) {
            return Bad(key, fmt::format("must be {} lowercase hex digits", len));
        }
        return s;
    }

    Result<int64_t> Int(std::string_view key, int64_t lo, int64_t hi) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v,
                               Get(key, Json::value_t::number_integer, "an integer"));
        return InRange(key, *v, lo, hi);
    }

    Result<uint64_t> Uint(std::string_view key) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v,
                               Get(key, Json::value_t::number_integer, "an integer"));
        if (!v->is_number_unsigned()) return Bad(key, "must not be negative");
        return v->get<uint64_t>();
    }

    Result<bool> Bool(std::string_view key) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::boolean, "a boolean"));
        return v->get<bool>();
    }

    // Any number (an integer too).
    Result<double> Number(std::string_view key) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::number_float, "a number"));
        return v->get<double>();
    }

    Result<JsonFields> Object(std::string_view key) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::object, "an object"));
        return JsonFields(*v, Name(key));
    }

    // An array of at most `max_len` elements.
    Result<const Json*> Array(std::string_view key, size_t max_len) const {
        FERRY_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::array, "an array"));
        if (v->size() > max_len) {
            return Bad(key, fmt::format("has more than {} elements", max_len));
        }
        return v;
    }

    // An array of integers in lo..hi, at most `max_len` of them.
    template <typename T>
    Result<std::vector<T>> IntArray(std::string_view key, int64_t lo, int64_t hi,
                                    size_t max_len) const {
        FERRY_ASSIGN_OR_RETURN(const Json* a, Array(key, max_len));
        std::vector<T> out;
        out.reserve(a->size());
        for (size_t i = 0; i < a->size(); ++i) {
            const Json& e = (*a)[i];
            std::string name = fmt::format("{}[{}]", key, i);
            if (!e.is_number_integer()) {
                return Bad(name, fmt::format("must be an integer, not {}", KindOf(e)));
            }
            FERRY_ASSIGN_OR_RETURN(int64_t x, InRange(name, e, lo, hi));
            out.push_back(static_cast<T>(x));
        }
        return out;
    }

    Status Bad(std::string_view key, std::string_view what) const {
        return InvalidArgumentError(fmt::format("field '{}' {}", Name(key), what));
    }

  private:
    Result<const Json*> Get(std::string_view key, Json::value_t want, const char* kind) const {
        if (!j_->is_object()) {
            return InvalidArgumentError(fmt::format(
                "'{}' must be an object, not {}", path_.empty() ? "message" : path_, KindOf(*j_)));
        }
        auto it = j_->find(key);
        if (it == j_->end()) return Bad(key, "is missing");
        const bool ok = want == Json::value_t::number_integer ? it->is_number_integer()
                        : want == Json::value_t::number_float ? it->is_number()
                                                              : it->type() == want;
        if (!ok) return Bad(key, fmt::format("must be {}, not {}", kind, KindOf(*it)));
        return &*it;
    }

    Result<int64_t> InRange(std::string_view key, const Json& v, int64_t lo, int64_t hi) const {
        if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
            return Bad(key, fmt::format("is outside {}..{}", lo, hi));
        }
        int64_t x = v.get<int64_t>();
        if (x < lo || x > hi) return Bad(key, fmt::format("= {} is outside {}..{}", x, lo, hi));
        return x;
    }

    const Json* j_;
    std::string path_;
};

}  // namespace ferry
