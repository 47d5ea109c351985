/* A minimal NVTX tool for tests: what Nsight Systems would receive, written to a file.
 *
 * NVTX calls are no-ops until a tool is injected (NVTX_INJECTION64_PATH names a shared
 * library; Nsight Systems injects its own). This one is injected by tests/test_profiling.py
 * in a subprocess and appends one tab-separated line per event to $DSV41_NVTX_RECORD:
 *
 *   domain  <handle> <name>
 *   string  <handle> <text>                          registered strings (range names)
 *   schema  <id> <field>:<type>:<offset>,...         payload schemas (payload extension)
 *   push    <thread> <domain> <message> <payload>    payload: none | i:<int64> | d:<double> |
 *                                                    ext:<schema id>:<hex bytes>
 *   pop     <thread> <domain>
 *
 * Only what the tests need is handled: the domain API that the nvtx Python package calls
 * (DomainCreateA, DomainRegisterStringA, DomainRangePushEx, DomainRangePop) and payload
 * schema registration. Built from the NVTX v3 headers that ship with CUDA and with the
 * CUDA build of torch (nvidia/cu13/include).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtPayload.h>

static FILE* out;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t next_schema = NVTX_PAYLOAD_SCHEMA_ID_DYNAMIC_START;

static long tid(void) { return (long)syscall(SYS_gettid); }

static void open_out(void) {
    if (out) return;
    const char* path = getenv("DSV41_NVTX_RECORD");
    out = fopen(path ? path : "/dev/stderr", "a");
    if (out) setvbuf(out, NULL, _IOLBF, 0);
}

static nvtxDomainHandle_t domain_create(const char* name) {
    /* a distinct non-null handle per domain: a heap copy of its name */
    char* h = strdup(name ? name : "");
    pthread_mutex_lock(&mu);
    fprintf(out, "domain\t%p\t%s\n", (void*)h, h);
    pthread_mutex_unlock(&mu);
    return (nvtxDomainHandle_t)h;
}

static nvtxStringHandle_t register_string(nvtxDomainHandle_t d, const char* s) {
    (void)d;
    char* h = strdup(s ? s : "");
    pthread_mutex_lock(&mu);
    fprintf(out, "string\t%p\t%s\n", (void*)h, h);
    pthread_mutex_unlock(&mu);
    return (nvtxStringHandle_t)h;
}

static void write_payload(const nvtxEventAttributes_t* a) {
    switch (a->payloadType) {
    case NVTX_PAYLOAD_TYPE_INT64: fprintf(out, "i:%" PRId64, a->payload.llValue); break;
    case NVTX_PAYLOAD_TYPE_UNSIGNED_INT64: fprintf(out, "i:%" PRIu64, a->payload.ullValue); break;
    case NVTX_PAYLOAD_TYPE_DOUBLE: fprintf(out, "d:%.17g", a->payload.dValue); break;
    case NVTX_PAYLOAD_TYPE_EXT: {
        /* reserved0 = number of nvtxPayloadData_t entries at payload.ullValue */
        const nvtxPayloadData_t* pd = (const nvtxPayloadData_t*)(uintptr_t)a->payload.ullValue;
        fprintf(out, "ext:%" PRIu64 ":", pd->schemaId);
        const unsigned char* p = (const unsigned char*)pd->payload;
        for (size_t i = 0; i < pd->size; ++i) fprintf(out, "%02x", p[i]);
        break;
    }
    default: fprintf(out, "none");
    }
}

static int range_push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
    pthread_mutex_lock(&mu);
    fprintf(out, "push\t%ld\t%s\t", tid(), d ? (const char*)d : "");
    if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED)
        fprintf(out, "%s\t", (const char*)a->message.registered);
    else if (a->messageType == NVTX_MESSAGE_TYPE_ASCII)
        fprintf(out, "%s\t", a->message.ascii);
    else
        fprintf(out, "\t");
    write_payload(a);
    fprintf(out, "\n");
    pthread_mutex_unlock(&mu);
    return 0;
}

static int range_pop(nvtxDomainHandle_t d) {
    pthread_mutex_lock(&mu);
    fprintf(out, "pop\t%ld\t%s\n", tid(), d ? (const char*)d : "");
    pthread_mutex_unlock(&mu);
    return 0;
}

static uint64_t schema_register(nvtxDomainHandle_t d, const nvtxPayloadSchemaAttr_t* attr) {
    (void)d;
    pthread_mutex_lock(&mu);
    uint64_t id = (attr->fieldMask & NVTX_PAYLOAD_SCHEMA_ATTR_FIELD_SCHEMA_ID) ? attr->schemaId : next_schema++;
    fprintf(out, "schema\t%" PRIu64 "\t", id);
    for (size_t i = 0; i < attr->numEntries; ++i) {
        const nvtxPayloadSchemaEntry_t* e = &attr->entries[i];
        fprintf(out, "%s%s:%" PRIu64 ":%" PRIu64, i ? "," : "", e->name ? e->name : "", e->type,
                e->offset);
    }
    fprintf(out, "\n");
    pthread_mutex_unlock(&mu);
    return id;
}

static uint8_t domain_is_enabled(nvtxDomainHandle_t d) { (void)d; return 1; }

NVTX_DYNAMIC_EXPORT int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    open_out();
    if (!out) return 0;
    const NvtxExportTableCallbacks* cb =
        (const NvtxExportTableCallbacks*)get_export_table(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = 0;
    unsigned int size = 0;
    if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size)) return 0;
    if (size <= NVTX_CBID_CORE2_DomainCreateA) return 0;
    *table[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)domain_create;
    *table[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)register_string;
    *table[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)range_push;
    *table[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)range_pop;
    return 1;
}

NVTX_DYNAMIC_EXPORT int InitializeInjectionNvtxExtension(nvtxExtModuleInfo_t* info) {
    open_out();
    if (!out || !info || info->moduleId != NVTX_EXT_PAYLOAD_MODULEID || info->segmentsCount < 1)
        return 0;
    intptr_t* slots = info->segments[0].functionSlots;
    size_t n = info->segments[0].slotCount;
    if (n > NVTX3EXT_CBID_nvtxPayloadSchemaRegister)
        slots[NVTX3EXT_CBID_nvtxPayloadSchemaRegister] = (intptr_t)schema_register;
    if (n > NVTX3EXT_CBID_nvtxDomainIsEnabled)
        slots[NVTX3EXT_CBID_nvtxDomainIsEnabled] = (intptr_t)domain_is_enabled;
    return 1;
}
